"""keeper:// single-copy saves: the rank copies its boxes into an arena the
host's keeper lent (shared memory) and the keeper takes the arena over as
the data file, checksummed and replicated there; eager, lazy and sync saves,
crc32c and layout as the normal writer's, abandoned arenas reclaimed."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from bytecp.storage.keeper_server import Keeper
from keepers import TOKEN, pair_fixture, spec
from torch import nn

import bytecp
from bytecp.errors import StorageError
from bytecp.format import metadata as fmt
from bytecp.loading.opened import open_checkpoint
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import verify

pair = pair_fixture("s0", "s1")


def state_of(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(128, 160), nn.ReLU(), nn.Linear(160, 3))  # 80 KiB and small boxes
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(4, 128)).sum().backward()
    opt.step()
    return {"model": m, "optim": opt, "extra": {"step": 7, "note": "x"}}


def bitwise(a: dict[str, object], b: dict[str, object]) -> None:
    for k, v in a["model"].state_dict().items():  # type: ignore[attr-defined]
        assert torch.equal(v, b["model"].state_dict()[k]), k  # type: ignore[attr-defined]
    sa, sb = a["optim"].state_dict()["state"], b["optim"].state_dict()["state"]  # type: ignore[attr-defined]
    for i, st in sa.items():
        for k, v in st.items():
            assert torch.equal(v, sb[i][k]), (i, k)


def chunks(url: str, **opts: object) -> dict[tuple[str, tuple[int, ...]], fmt.ChunkRecord]:
    return {(c.fqn, tuple(c.offsets)): c for c in open_checkpoint(open_storage(url, **opts)).all_rows()}


def adopted(keepers: list[Keeper]) -> int:
    return sum(k.arenas.adopted_bytes for k in keepers)


@pytest.mark.parametrize("mode", ["sync", "eager", "lazy", "budget"])
def test_the_keeper_adopts_the_arena_crc_and_layout_as_the_writer(pair: list[Keeper], tmp_path: Path,
                                                                    mode: str) -> None:
    opts = {"keepers": spec(pair), "host": "s0", "token": TOKEN}
    url = f"keeper://job/{uuid.uuid4().hex}/step-1"
    state = state_of(0)
    before = adopted(pair)
    if mode == "sync":
        bytecp.save(url, state, storage_options=opts)
    else:
        budget = 100_000 if mode == "budget" else None  # batches, each in an arena of its own
        h = bytecp.async_save(url, state, lazy=mode == "lazy", memory_budget_bytes=budget, storage_options=opts)
        if mode == "lazy":
            state["optim"].step()  # type: ignore[attr-defined]  # the pre-step hook waits for the copy
            state = state_of(0)  # the saved values (the step above changed the live ones after the copy)
        h.wait()
    bytecp.save(str(tmp_path / "disk"), state)  # the normal writer, same state
    mem, disk = chunks(url, **opts), chunks(str(tmp_path / "disk"))
    assert mem.keys() == disk.keys()
    for key, c in mem.items():
        assert c.crc32c == disk[key].crc32c and c.blocks == disk[key].blocks, key  # block checksums too
        if c.nbytes:
            assert c.byte_offset % fmt.ALIGNMENT == 0, key  # page-aligned, as the writer lays it out
    md = fmt.Metadata.from_bytes(open_storage(url, **opts).read_bytes(fmt.METADATA_FILE), url)
    tensor_files = {c.file for c in mem.values()}
    grew = adopted(pair) - before
    assert grew == sum(md.data_files[f] for f in tensor_files) > 0  # not written: adopted
    assert len(tensor_files) == (1 if mode != "budget" else len(tensor_files) > 1 and len(tensor_files))
    for k in pair:  # both copies of the adopted file
        for f in tensor_files:
            assert os.path.getsize(k._full(f"{url[len('keeper://'):]}/{f}")) == md.data_files[f]
    target = state_of(1)
    bytecp.load(url, target, storage_options=opts)
    bitwise(state, target)
    checked, problems = verify(open_storage(url, **opts))  # every chunk read back against its crc32c
    assert checked and not problems


def test_retention_recycles_data_files_into_the_arena_pool(pair: list[Keeper]) -> None:
    opts = {"keepers": spec(pair), "host": "s0", "token": TOKEN}
    run = f"keeper://job/{uuid.uuid4().hex}"
    big = {"w": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB: pooled when deleted
    bytecp.save(f"{run}/step-1", big, storage_options=opts)
    free = pair[0].arenas.stats()["free"]
    open_storage(f"{run}/step-1", **opts).delete_prefix()
    assert pair[0].arenas.stats()["free"] == free + 1
    lent_before = pair[0].arenas.lent_bytes
    bytecp.save(f"{run}/step-2", big, storage_options=opts)  # lent the pooled file
    assert pair[0].arenas.stats()["free"] == free
    assert pair[0].arenas.lent_bytes > lent_before
    out = {"w": torch.zeros(1 << 19)}
    bytecp.load(f"{run}/step-2", out, storage_options=opts)
    assert torch.equal(out["w"], big["w"])


_KILLED = """
import sys, torch, bytecp
state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
bytecp.async_save(sys.argv[1], state, storage_options={"keepers": sys.argv[2], "host": "s0", "token": sys.argv[3]})
"""


@pytest.mark.spawn
def test_a_rank_killed_after_alloc_commits_nothing_and_its_arena_is_reclaimed(pair: list[Keeper]) -> None:
    run = f"keeper://job/{uuid.uuid4().hex}"
    lent = set(pair[0].arenas.lent)
    env = dict(os.environ, BYTECP_FAULT_EXIT="write:0")  # dies after the copy into the arena, before adopt
    out = subprocess.run([sys.executable, "-c", _KILLED, f"{run}/step-1", spec(pair), TOKEN],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0, out.stderr
    (name,) = set(pair[0].arenas.lent) - lent
    st = open_storage(run, keepers=spec(pair), host="s0", token=TOKEN)
    assert fmt.METADATA_FILE not in {p.rsplit("/", 1)[-1] for p in st.list_files()}  # nothing committed
    pair[0].arenas.reclaim()  # (at every alloc) its process is gone
    assert name not in pair[0].arenas.lent


def test_a_failed_save_gives_its_arena_back_at_the_next_save(pair: list[Keeper], monkeypatch) -> None:
    opts = {"keepers": spec(pair), "host": "s0", "token": TOKEN}
    run = f"keeper://job/{uuid.uuid4().hex}"
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "write:0")
    with pytest.raises(RuntimeError):
        bytecp.save(f"{run}/step-1", state, storage_options=opts)
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    gc.collect()
    reclaimed = pair[0].arenas.reclaimed
    bytecp.save(f"{run}/step-2", state, storage_options=opts)  # names the dropped arena at its alloc
    assert pair[0].arenas.reclaimed == reclaimed + 1 and not pair[0].arenas.lent


def test_an_arena_lent_too_long_is_unlinked(tmp_path: Path) -> None:
    from bytecp.storage._keeper_arenas import Arenas

    arenas = Arenas(str(tmp_path), timeout_s=0.0)
    name, path, _ = arenas.lend(4096, os.getpid())
    arenas.reclaim()
    assert not os.path.exists(path) and name not in arenas.lent
    with pytest.raises(StorageError, match="reclaimed"):
        arenas.adopt(name, str(tmp_path / "d"), 4096, [(0, 4096)])


def test_a_large_save_is_lent_an_arena_per_data_file(pair: list[Keeper]) -> None:
    """36 MB of boxes, io_threads=4: spread over 2 arenas as the writer would
    spread them over data files (32 MB each at most), replicated in parallel."""
    opts = {"keepers": spec(pair), "host": "s0", "token": TOKEN}
    url = f"keeper://job/{uuid.uuid4().hex}/step-1"
    state = {k: torch.arange(3 << 20, dtype=torch.float32) + i for i, k in enumerate("abc")}
    before = adopted(pair)
    bytecp.save(url, state, storage_options=opts)
    md = fmt.Metadata.from_bytes(open_storage(url, **opts).read_bytes(fmt.METADATA_FILE), url)
    files = {c.file for c in chunks(url, **opts).values()}
    assert len(files) == 2 and adopted(pair) - before == sum(md.data_files[f] for f in files)
    out = {k: torch.zeros(3 << 20) for k in "abc"}
    bytecp.load(url, out, storage_options=opts)
    assert all(torch.equal(out[k], state[k]) for k in "abc")
    open_storage(url, **opts).delete_prefix()


def test_a_mapping_is_reused_while_its_file_lives_and_let_go_once_unlinked(tmp_path: Path) -> None:
    from bytecp.storage._keeper_maps import Mappings

    maps = Mappings(keep=4)
    (tmp_path / "a").write_bytes(bytes(8192))
    first = maps.map(str(tmp_path / "a"))
    assert maps.map(str(tmp_path / "a")) is first and (maps.hits, maps.misses) == (1, 1)
    os.unlink(tmp_path / "a")  # the keeper evicted it: the next lend lets the mapping go
    (tmp_path / "b").write_bytes(bytes(4096))
    maps.map(str(tmp_path / "b"))
    assert len(maps._maps) == 1


def test_an_arena_mostly_unwritten_is_copied_out_not_adopted(tmp_path: Path) -> None:
    """A rank whose plan writes few of the boxes it copied (replicas another
    rank writes): the keeper copies those out, page-aligned, crc32c as the writer's."""
    from bytecp.storage._keeper_arenas import Arenas

    from bytecp.format.checksum import crc32c, sums

    arenas = Arenas(str(tmp_path))
    name, path, size = arenas.lend(16 * fmt.ALIGNMENT, os.getpid())
    data = os.urandom(size)
    with open(path, "r+b") as f:
        f.write(data)
    ranges = [(3 * fmt.ALIGNMENT, 100), (9 * fmt.ALIGNMENT, fmt.ALIGNMENT + 5)]
    crcs, starts, n = arenas.adopt(name, str(tmp_path / "ck" / "d"), size, ranges)
    assert starts == [0, fmt.ALIGNMENT] and n == 3 * fmt.ALIGNMENT and not os.path.exists(path)
    out = (tmp_path / "ck" / "d").read_bytes()
    for (o, k), s, c in zip(ranges, starts, crcs, strict=True):
        assert out[s:s + k] == data[o:o + k] and c == sums(data[o:o + k]) and c.crc == crc32c(data[o:o + k])
    assert out[100:fmt.ALIGNMENT] == bytes(fmt.ALIGNMENT - 100)  # the writer's zero padding


def test_the_keeper_metrics_count_arenas_and_bytes_adopted_vs_written(pair: list[Keeper]) -> None:
    from bytecp.monitoring.keeper_metrics import KeeperCollector
    from prometheus_client import CollectorRegistry

    regs = []
    for k in pair:
        reg = CollectorRegistry()
        reg.register(KeeperCollector(lambda k=k: k.op_stats({}, memoryview(b""))[0], "j"))  # type: ignore[misc]
        regs.append(reg)

    def value(i: int, name: str, **labels: str) -> float:
        got = regs[i].get_sample_value(name, {"job": "j", "host": pair[i].name, **labels})
        assert got is not None, (name, labels)
        return got

    def figures() -> dict[str, float]:
        return {"lent": value(0, "bytecp_keeper_arena_events_total", event="lent"),
                "adopted": value(0, "bytecp_keeper_arena_events_total", event="adopted"),
                "adopted_b": value(0, "bytecp_keeper_data_bytes_total", how="adopted"),
                "written_b": value(0, "bytecp_keeper_data_bytes_total", how="written"),
                "received_b": value(1, "bytecp_keeper_data_bytes_total", how="received"),
                "cpu": value(0, "bytecp_keeper_cpu_seconds_total")}

    opts = {"keepers": spec(pair), "host": "s0", "token": TOKEN}
    run = f"keeper://job/{uuid.uuid4().hex}"
    big = {"w": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB
    before = figures()
    bytecp.save(f"{run}/step-1", big, storage_options=opts)  # single copy: an arena adopted
    one = figures()
    assert one["lent"] == before["lent"] + 1 and one["adopted"] == before["adopted"] + 1
    assert one["adopted_b"] - before["adopted_b"] >= 2 << 20
    assert one["written_b"] - before["written_b"] < 1 << 16  # the index and small objects only
    assert one["received_b"] - before["received_b"] >= 2 << 20  # s1's copy
    assert one["cpu"] >= before["cpu"] > 0
    bytecp.save(f"{run}/step-2", big, storage_options=dict(opts, single_copy=False))  # the rank writes
    two = figures()
    assert two["written_b"] - one["written_b"] >= 2 << 20 and two["adopted_b"] == one["adopted_b"]
    pool = value(0, "bytecp_keeper_arena_pool_bytes")
    free = value(0, "bytecp_keeper_arenas", state="free")
    open_storage(f"{run}/step-1", **opts).delete_prefix()  # retention: the data file goes to the pool
    assert value(0, "bytecp_keeper_arena_pool_bytes") >= pool + (2 << 20)
    assert value(0, "bytecp_keeper_arenas", state="free") == free + 1
    assert value(0, "bytecp_keeper_arenas", state="lent") == 0


def test_a_copied_out_arena_joins_the_pool_at_its_commit_and_is_lent_back(pair: list[Keeper]) -> None:
    """The keeper copies a mostly unwritten arena's boxes out; the arena waits
    for the checkpoint's commit (the save may still read it), then pools."""
    opts = {"keepers": spec(pair), "host": "s0", "token": TOKEN}
    st = open_storage(f"keeper://job/{uuid.uuid4().hex}/step-1", **opts)
    arenas = pair[0].arenas
    before = arenas.stats()
    nbytes = (5 << 20) + 7 * fmt.ALIGNMENT  # no other test's pooled arena fits it
    arena = st.staging_arena(nbytes)  # type: ignore[attr-defined]
    assert arena is not None
    inode = os.stat(arenas.lent[arena.name].path).st_ino
    arena.buffer[:100] = bytes(range(100))
    arena.used = arena.nbytes
    st.adopt("d0", arena, [(0, 100)])  # type: ignore[attr-defined]  # 1 page of 1287: copied out
    mid = arenas.stats()
    assert mid["copied_out"] == before["copied_out"] + 1 and mid["returning"] == before["returning"] + 1
    assert mid["free"] == before["free"]  # not before the commit
    assert st.read_bytes("d0", 0, 100) == bytes(range(100))
    st.commit("metadata.json", b"{}")
    after = arenas.stats()
    assert after["returning"] == before["returning"] and after["free"] == before["free"] + 1
    again = st.staging_arena(nbytes)  # type: ignore[attr-defined]  # lent back to this process
    assert again is not None and os.stat(arenas.lent[again.name].path).st_ino == inode
    arenas.release([again.name])


def test_a_copied_out_arena_whose_checkpoint_never_commits_is_dropped(tmp_path: Path) -> None:
    from bytecp.storage._keeper_arenas import Arenas

    arenas = Arenas(str(tmp_path), timeout_s=3600)
    for ckpt in ("run/step-1", "run/step-2"):
        name, _, size = arenas.lend(16 * fmt.ALIGNMENT, os.getpid())
        arenas.adopt(name, str(tmp_path / ckpt / "d"), size, [(0, 100)], ckpt)
    assert arenas.stats()["returning"] == 2
    assert arenas.drop_free() == 16 * fmt.ALIGNMENT  # room for the budget: these go first
    arenas.timeout_s = 0.0
    arenas.reclaim()  # (at every lend) the other outlived the timeout
    assert arenas.stats()["returning"] == 0 and arenas.returning == {}
    assert [f for f in os.listdir(arenas.dir)] == []


def test_the_pool_holds_every_prewarmed_rotation(tmp_path: Path) -> None:
    """pool_max is a floor: processes that prewarmed more arenas between them
    get them all back in the pool, not only the first pool_max."""
    from bytecp.storage._keeper_arenas import MIN_POOLED, Arenas

    arenas = Arenas(str(tmp_path), pool_max=1)
    arenas.prepare(MIN_POOLED, 3, os.getpid())
    lent = [arenas.lend(MIN_POOLED, os.getpid()) for _ in range(3)]
    assert not arenas.free
    for name, _, _ in lent:
        arenas.adopt(name, str(tmp_path / "ck" / name), MIN_POOLED, [(0, MIN_POOLED)])
        assert arenas.recycle(str(tmp_path / "ck" / name))  # (the checkpoint retired)
    assert len(arenas.free) == 3
