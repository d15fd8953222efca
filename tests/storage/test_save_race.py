"""Independent jobs racing ``bytecp.save`` to one URL without ``overwrite``:
exactly one commits, every other gets ``CheckpointExistsError``, the
winner's checkpoint loads bitwise and the losers leave no file behind
(local disk and a real Ceph RADOS Gateway)."""

from __future__ import annotations

import os
import queue
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import race_worker
import torch
from dist.pool import context as pool_context
from spawning import spawns

import bytecp
from bytecp.format import metadata as fmt
from bytecp.storage_api import open_storage

WORKERS = 3
REPETITIONS = 20


class Racers:
    """``WORKERS`` processes (started once), each an independent job.

    Forked from the suite's fork server (``tests/dist/pool.py``), which
    imported torch and bytecp once: a spawned process paid that import
    (10-20 s for three on 2 cores) and its interpreter's finalization at
    exit (~10 s); a forked one leaves through ``os._exit``."""

    def __init__(self) -> None:
        ctx = pool_context()
        self.barrier = ctx.Barrier(WORKERS)
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(WORKERS)]
        env = dict(os.environ)  # what a spawned process would have started with
        self.procs = [
            ctx.Process(target=race_worker.run, args=(i, self.jobs[i], self.results, self.barrier, env),
                        daemon=True)
            for i in range(WORKERS)
        ]
        for p in self.procs:
            p.start()

    def race(self, url: str, options: dict[str, Any], rep: int) -> dict[int, tuple[str, str]]:
        for q in self.jobs:
            q.put((url, options, rep))
        out = {}
        for _ in range(WORKERS):
            try:
                r, worker, outcome, msg = self.results.get(timeout=120)
            except queue.Empty:
                pytest.fail(f"repetition {rep}: a racing save never answered (hang)")
            assert r == rep
            out[worker] = (outcome, msg)
        return out

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
@spawns
def racers() -> Iterator[Racers]:
    r = Racers()
    yield r
    r.close()


def check_race(racers: Racers, url_of: Any, options: dict[str, Any]) -> None:
    at_commit = 0
    for rep in range(REPETITIONS):
        url = url_of(rep)
        outcomes = racers.race(url, options, rep)
        errors = {w: m for w, (o, m) in outcomes.items() if o == "error"}
        assert not errors, errors
        winners = [w for w, (o, _) in outcomes.items() if o == "won"]
        assert len(winners) == 1, (rep, outcomes)
        for o, msg in outcomes.values():
            if o == "lost":
                assert url.rstrip("/") in msg or "metadata.json" in msg, msg
                at_commit += "another save committed here first" in msg
        # the winner's state loads bitwise
        want = race_worker.state_of(winners[0], rep)
        sd = bytecp.load_state_dict(url, storage_options=options)
        for k, t in want["model"].items():
            assert torch.equal(sd["model"][k], t), (rep, k)
        assert sd["extra"] == want["extra"]
        # the losers left nothing: every file belongs to the winner's save
        st = open_storage(url, **options)
        md = fmt.Metadata.from_bytes(st.read_bytes(fmt.METADATA_FILE), url)
        files = set(st.list_files())
        stray = {f for f in files - md.referenced_files() - {fmt.METADATA_FILE} if not f.startswith("reports/")}
        assert not stray, (rep, sorted(stray))
        st.delete_prefix()
    # the jobs really raced at the commit (not only at the up-front existence check)
    assert at_commit >= REPETITIONS, at_commit


def test_racing_saves_to_one_local_url(racers: Racers, tmp_path) -> None:
    check_race(racers, lambda rep: str(tmp_path / f"race-{rep}"), {})


@pytest.mark.s3
@pytest.mark.ceph
def test_racing_saves_to_one_s3_url_on_ceph(racers: Racers, ceph_rgw, ceph_bucket) -> None:
    prefix = uuid.uuid4().hex[:8]
    check_race(racers, lambda rep: f"s3://{ceph_bucket}/race-{prefix}/{rep}", ceph_rgw.options())
