"""bytecp.save/load end to end on S3 (moto and Ceph RGW): bitwise round trips, one-process
loads, and a training run's checkpoints managed under an S3 prefix."""

from __future__ import annotations

import json

import pytest
import torch
from bytecp.storage.testing import MiB

import bytecp
from bytecp.errors import IncompleteCheckpointError
from bytecp.manager import list_checkpoints
from bytecp.storage_api import open_storage

pytestmark = pytest.mark.s3

SMALL_PARTS = {"part_size": 5 * MiB, "read_part_size": 2 * MiB}


def trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(700, 900), torch.nn.GELU(), torch.nn.Linear(900, 500), torch.nn.LayerNorm(500))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 700)).square().mean().backward()
    opt.step()
    return model, opt


def test_save_load_bitwise(s3, unique_prefix):
    server, bucket = s3
    opts = server.options(**SMALL_PARTS)
    url = f"s3://{bucket}/{unique_prefix}/step-1"
    model, opt = trained(0)
    extra = {"step": 1, "note": "s3"}
    bytecp.save(url, {"model": model, "optimizer": opt, "extra": extra}, storage_options=opts)

    m2, o2 = trained(1)
    extra2 = {"step": -1, "note": ""}
    bytecp.load(url, {"model": m2, "optimizer": o2, "extra": extra2}, storage_options=opts)
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    for pid, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(o2.state_dict()["state"][pid][name])), (pid, name)
    assert extra2 == extra

    sd = bytecp.load_state_dict(url, storage_options=opts)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd["model"][k]), k
    open_storage(url, **opts).delete_prefix()


def test_a_save_to_a_missing_bucket_names_it_and_no_files_left(s3, unique_prefix):
    """A bucket that does not exist: one error naming it; the note that files
    of the failed save remain (and to run gc) was wrong: nothing was written."""
    from bytecp.errors import StorageNotFoundError

    server, _ = s3
    url = f"s3://no-such-bucket-{unique_prefix.lower()[-12:].strip('-')}/run/step-1"
    model, _ = trained(0)
    with pytest.raises(StorageNotFoundError) as e:
        bytecp.save(url, {"model": model}, storage_options=server.options())
    assert "no-such-bucket" in str(e.value) and not getattr(e.value, "__notes__", None), e.value.__notes__


def test_uncommitted_prefix_is_not_a_checkpoint(s3, unique_prefix):
    server, bucket = s3
    url = f"s3://{bucket}/{unique_prefix}/half"
    st = open_storage(url, **server.options())
    st.write_file("data/x/0-0.bin", [b"orphan bytes of an interrupted save"])
    model, opt = trained(0)
    with pytest.raises(IncompleteCheckpointError):
        bytecp.load(url, {"model": model}, storage_options=server.options())
    st.delete_prefix()


def test_a_save_sweeps_an_earlier_saves_orphans_on_s3(s3, unique_prefix):
    """The sweep after a commit finds other saves' folders by name (a
    delimiter listing) and removes a dead save's objects, none of its own."""
    from bytecp.format.metadata import new_save_id

    server, bucket = s3
    url = f"s3://{bucket}/{unique_prefix}/ck"
    st = open_storage(url, **server.options())
    dead = "1" + new_save_id()[1:]  # started long ago, no lease: it cannot be running
    st.write_file(f"data/{dead}/0-0.bin", [b"orphan bytes"])
    st.write_file(f"index/{dead}/0.bin", [b"orphan index"])
    model, _ = trained(0)
    bytecp.save(url, {"model": model}, storage_options=server.options())
    left = st.list_files()
    assert not any(dead in f for f in left), left
    sid = json.loads(st.read_bytes("metadata.json"))["save_id"]
    assert any(f.startswith(f"data/{sid}/") for f in left) and any(f.startswith(f"index/{sid}/") for f in left), left
    sd = bytecp.load_state_dict(url, storage_options=server.options())
    assert all(torch.equal(v, sd["model"][k]) for k, v in model.state_dict().items())
    st.delete_prefix()


@pytest.mark.ceph
def test_checkpoint_manager_on_s3(ceph_rgw, ceph_bucket, unique_prefix):
    run = f"s3://{ceph_bucket}/{unique_prefix}/run"
    opts = ceph_rgw.options(**SMALL_PARTS)
    # whole saves: this checks that retention removes every object on S3 (retiring a
    # referenced base instead is tests/core/test_incremental.py's)
    mgr = bytecp.CheckpointManager(run, every_n_steps=10, keep_last=2, storage_options=opts, incremental=False)
    model, opt = trained(0)
    for step in (10, 20, 30):
        with torch.no_grad():
            model[0].bias.fill_(step)
        assert mgr.maybe_save(step, {"model": model, "optimizer": opt})
    assert [c.step for c in list_checkpoints(run, storage_options=opts)] == [20, 30]
    root = open_storage(run, **opts)
    assert root.list_children() == ["step-20", "step-30"]  # step-10's objects are gone, not just its metadata
    m2, o2 = trained(5)
    assert mgr.restore({"model": m2, "optimizer": o2}) == 30
    assert torch.equal(m2[0].bias, torch.full_like(m2[0].bias, 30))
    assert root.child("step-30").list_incomplete_uploads() == []
    root.delete_prefix()


def test_incremental_saves_pins_and_retention_on_s3(s3, unique_prefix):
    """The pin/doom protocol on an object store (no rename, no lock): a save
    whose referenced file is doomed fails and leaves no pin; retention retires
    the base, keeping what the newer checkpoint reads; that one loads bitwise."""
    from bytecp.errors import CorruptCheckpointError
    from bytecp.tools.retention import retain

    server, bucket = s3
    opts = server.options()
    run = f"s3://{bucket}/{unique_prefix}/run"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    model[0].requires_grad_(False)
    bytecp.save(f"{run}/step-1", {"model": model}, step=1, storage_options=opts)
    with torch.no_grad():
        model[1].weight.add_(1.0)
    md = bytecp.save(f"{run}/step-2", {"model": model}, step=2, base=f"{run}/step-1", storage_options=opts)
    at2 = {k: v.clone() for k, v in model.state_dict().items()}
    (ref,) = {f.split("/", 2)[2] for f in md.data_files if f.startswith("../step-1/")}
    root, base = open_storage(run, **opts), open_storage(f"{run}/step-1", **opts)
    base.commit("doomed/20000101T000000-other.json", b'{"files": ["%s"]}' % ref.encode())
    with torch.no_grad():
        model[1].weight.add_(1.0)
    with pytest.raises(CorruptCheckpointError, match="being pruned"):
        bytecp.save(f"{run}/step-3", {"model": model}, step=3, base=f"{run}/step-2", storage_options=opts)
    assert not base.list_files("pins")
    base.delete(["doomed/20000101T000000-other.json"])
    res = retain(root, ["step-2"], ["step-1"], lambda: ["step-2"])
    assert res.retired == ["step-1"] and set(base.list_files("")) == {"base.json", ref}
    sd = bytecp.load_state_dict(f"{run}/step-2", storage_options=opts)
    assert set(sd["model"]) == set(at2) and all(torch.equal(sd["model"][k], v) for k, v in at2.items())
    root.delete_prefix()


def test_a_run_of_many_checkpoints_is_read_on_threads(s3, unique_prefix, monkeypatch):
    """A follower's poll, a resume, a retention list every checkpoint's header:
    on S3 the folders are read on the scan's threads, and the answer is the
    run's every committed step, in order, the newest the resume decision's first."""
    import threading

    from bytecp import catalog
    from bytecp.tools.resume import decide

    server, bucket = s3
    opts = server.options()
    run = f"s3://{bucket}/{unique_prefix}/run"
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=None, storage_options=opts)
    model = torch.nn.Linear(4, 4)
    for step in range(1, 7):
        mgr.save(step, {"model": model})
    open_storage(run, **opts).write_file("notes.txt", [b"not a checkpoint"])
    threads: set[str] = set()
    real = catalog._scan_one

    def scan_one(*a):
        threads.add(threading.current_thread().name)
        return real(*a)

    monkeypatch.setattr(catalog, "_scan_one", scan_one)
    assert [c.step for c in list_checkpoints(run, storage_options=opts)] == [1, 2, 3, 4, 5, 6]
    assert [c.step for c in decide(run, opts).candidates()][:2] == [6, 5]
    assert threads and all(n.startswith("bytecp-scan") for n in threads), threads
    open_storage(run, **opts).delete_prefix()
