"""Crafted checkpoints: every size is checked before anything is allocated,
nesting is bounded, links out of the checkpoint are refused, and every
failure is a typed error naming the file and the entry at fault."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import bytecp
from bytecp.cli import main as cli
from bytecp.errors import ConfigError, CorruptCheckpointError
from bytecp.format import limits, segment_wire
from bytecp.format import metadata as fmt
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import summarize, verify

from .helpers import as_object_form, tensor_specs
from .index_tools import encode_segment, index_file, index_rows, rewrite_index


def saved(tmp_path: Path, state: dict | None = None) -> Path:
    ck = tmp_path / "ck"
    bytecp.save(str(ck), state or {"w": torch.arange(6, dtype=torch.float32), "opt": {"lr": 0.5, "betas": (0.9, 0.99)}})
    return ck


def md_of(ck: Path) -> dict:
    return json.loads((ck / "metadata.json").read_text())


def write_md(ck: Path, md: dict) -> None:
    (ck / "metadata.json").write_text(json.dumps(md))


def index_path(ck: Path) -> Path:
    return index_file(ck)


def only_chunk(ck: Path) -> fmt.ChunkRecord:
    (row,) = index_rows(ck).to_pylist()
    info = tensor_specs(md_of(ck))[row["fqn"]]
    return fmt.ChunkRecord(row["fqn"], info["dtype"], tuple(info["shape"]), tuple(row["offsets"]),
                           tuple(row["lengths"]), row["file"], row["byte_offset"], row["nbytes"], row["crc32c"])


def rows_of(*chunks: fmt.ChunkRecord) -> dict:
    return {"fqn": [c.fqn for c in chunks], "offsets": [list(c.offsets) for c in chunks],
            "lengths": [list(c.lengths) for c in chunks], "file": [c.file for c in chunks],
            "byte_offset": [c.byte_offset for c in chunks], "nbytes": [c.nbytes for c in chunks],
            "crc32c": pa.array([c.crc32c for c in chunks], pa.uint32()),
            "blocks": [list(np.frombuffer(c.blocks, "<u4").tolist()) for c in chunks]}


def readers(ck: Path) -> list:
    st = open_storage(str(ck))
    return [
        ("load_state_dict", lambda: bytecp.load_state_dict(str(ck))),
        ("inspect", lambda: summarize(st)),
        ("verify", lambda: verify(st)),
    ]


def all_refuse(ck: Path, match: str) -> None:
    for name, fn in readers(ck):
        with pytest.raises(CorruptCheckpointError, match=match):
            fn()
        assert name


def test_a_consistent_terabyte_shape_is_refused_before_allocation(tmp_path: Path) -> None:
    """metadata, index and data_files agree on a 10^12-element tensor; only the
    real file size tells: a typed error, no 4 TB allocation."""
    ck = saved(tmp_path, {"w": torch.zeros(4)})
    md = md_of(ck)
    n = 10**12
    as_object_form(md)["w"]["shape"] = [n]
    (data_file,) = md["data_files"]
    md["data_files"][data_file] = 4 * n
    md["index"]["block_bytes"] = 1 << 30  # the largest blocks: 3,726 block checksums, as a writer would record
    write_md(ck, md)
    c = only_chunk(ck)
    big = fmt.ChunkRecord(c.fqn, c.dtype, (n,), (0,), (n,), c.file, 0, 4 * n, c.crc32c, bytes(4 * -(-4 * n // (1 << 30))))
    rewrite_index(ck, rows_of(big))
    for name, fn in readers(ck)[:2]:
        with pytest.raises(CorruptCheckpointError, match=rf"{data_file}.*'w'.*truncated.*{4 * n}"):
            fn()
        assert name
    _, problems = verify(open_storage(str(ck)))
    text = "\n".join(map(str, problems))
    assert "size 4096 B, metadata says 4000000000000 B" in text


def test_tensors_larger_than_all_data_are_refused(tmp_path: Path) -> None:
    """A tensor with no chunks at all (the index cannot tile-check it) still cannot be allocated."""
    ck = saved(tmp_path, {"w": torch.zeros(4)})
    md = md_of(ck)
    as_object_form(md)["ghost"] = {"dtype": "float32", "shape": [10**6, 10**6]}
    write_md(ck, md)
    with pytest.raises(CorruptCheckpointError, match="'ghost'.*larger in total than all its data files"):
        bytecp.load_state_dict(str(ck))


def test_blob_claiming_a_terabyte_names_the_object(tmp_path: Path) -> None:
    ck = saved(tmp_path, {"w": torch.zeros(4), "o": {"f": 1.5, "t": (1, float("inf"))}})
    md = md_of(ck)
    name = next(k for k, v in md["objects"].items() if "file" in v)
    md["objects"][name]["nbytes"] = 10**12
    write_md(ck, md)
    for _, fn in readers(ck)[:2]:
        with pytest.raises(CorruptCheckpointError, match=rf"object '{name}' claims bytes"):
            fn()
    assert verify(open_storage(str(ck)))[1]


def test_negative_blob_offset_names_the_object(tmp_path: Path) -> None:
    ck = saved(tmp_path, {"w": torch.zeros(4), "o": {"t": (1, float("inf"))}})
    md = md_of(ck)
    name = next(k for k, v in md["objects"].items() if "file" in v)
    md["objects"][name]["byte_offset"] = -4096
    write_md(ck, md)
    all_refuse(ck, rf"object '{name}' at byte -4096")


def test_data_file_size_of_a_petabyte_is_not_reported(tmp_path: Path) -> None:
    """inspect used to print 909.5 TiB for a data_files entry nobody checked."""
    ck = saved(tmp_path)
    md = md_of(ck)
    (f,) = md["data_files"]
    md["data_files"][f] = 10**15
    write_md(ck, md)
    with pytest.raises(CorruptCheckpointError, match=rf"{f}.*truncated.*10{{15}}|{f}.*{10**15}"):
        summarize(open_storage(str(ck)))
    with pytest.raises(CorruptCheckpointError, match=f):
        bytecp.load_state_dict(str(ck))
    assert cli(["inspect", str(ck)]) == 2


@pytest.mark.parametrize("depth", [300, 100_000])
def test_deep_skeleton_is_a_typed_error_not_a_recursion_error(tmp_path: Path, depth: int) -> None:
    ck = saved(tmp_path)
    md = md_of(ck)
    node: dict = {"obj": "leaf"}
    md["objects"]["leaf"] = {"json": 1}
    for _ in range(depth):
        node = {"l": [node]}
    md["skeleton"] = node
    raw = json.dumps(md, check_circular=False) if depth < 900 else _deep_json(md, depth)
    (ck / "metadata.json").write_text(raw)
    all_refuse(ck, "nested deeper than 256|not valid JSON")
    assert cli(["verify", str(ck)]) == 2 and cli(["inspect", str(ck)]) == 2


def _deep_json(md: dict, depth: int) -> str:
    """json.dumps recurses too: write the nesting by hand."""
    md = dict(md)
    md["skeleton"] = "SKELETON"
    return json.dumps(md).replace('"SKELETON"', '{"l": [' * depth + '{"obj": "leaf"}' + "]}" * depth)


def test_nesting_within_the_budget_round_trips(tmp_path: Path) -> None:
    tree: dict = {"leaf": torch.ones(2)}
    for i in range(limits.MAX_SKELETON_DEPTH - 8):
        tree = {f"k{i % 3}": tree}
    ck = tmp_path / "deep"
    bytecp.save(str(ck), {"t": tree})
    sd = bytecp.load_state_dict(str(ck))
    node = sd["t"]
    while "leaf" not in node:
        (node,) = node.values()
    assert torch.equal(node["leaf"], torch.ones(2))


def test_bad_tensor_specs(tmp_path: Path) -> None:
    for spec, match in [
        ({"dtype": "float32", "shape": [-1]}, "shape"),
        ({"dtype": "float32", "shape": [1] * 65}, "shape"),
        ({"dtype": "float32", "shape": ["4"]}, "shape"),
        ({"dtype": "evil", "shape": [4]}, "unknown dtype"),
        ({"dtype": ["float32"], "shape": [4]}, "unknown dtype"),
        ([4], "not an object"),
    ]:
        ck = saved(tmp_path / str(len(os.listdir(tmp_path))))
        md = md_of(ck)
        as_object_form(md)["w"] = spec
        write_md(ck, md)
        all_refuse(ck, match)


def test_index_with_millions_of_rows_in_a_few_kilobytes(tmp_path: Path) -> None:
    """A segment whose header claims 3 million rows in a few words: the
    directory's count is refused against the budget first; when the
    directory agrees with the bytes read, the header is refused against the
    segment's real size before anything is allocated from it."""
    ck = saved(tmp_path, {"w": torch.zeros(4)})
    c = only_chunk(ck)
    n = 3_000_000
    real = encode_segment(rows_of(c), md_of(ck)["save_id"], blocks=True)  # format version 5's encoding
    words = np.frombuffer(real, "<i8").copy()
    words[1] = n  # rows: the columns would need 144 MB
    crafted = words.tobytes()
    assert len(crafted) < 1000
    rewrite_index(ck, crafted, nrows=n)
    all_refuse(ck, rf"directory.bin: the index directory lists {n} rows, more than the")
    rewrite_index(ck, crafted, nrows=1)  # the directory lies too
    all_refuse(ck, rf"{index_path(ck).name} segment at bytes 0\.\.{len(crafted)} has {n} rows, the directory says 1")
    with pytest.raises(CorruptCheckpointError, match=rf"\(rows {n}, .* makes it \d+ bytes, not {len(crafted)}"):
        segment_wire.decode("seg", crafted, n, md_of(ck)["save_id"], block_bytes=md_of(ck)["index"]["block_bytes"])


def test_index_with_a_huge_list_cell(tmp_path: Path) -> None:
    ck = saved(tmp_path, {"w": torch.zeros(4)})
    c = only_chunk(ck)
    bad = fmt.ChunkRecord(c.fqn, c.dtype, (4,), (0,) * 1_000_000, (1,) * 1_000_000, c.file, 0, 16, c.crc32c)
    rewrite_index(ck, rows_of(bad))
    all_refuse(ck, "row 0 has 1000000 dimensions \\(0 to 64 allowed\\)")  # before any row is built


def test_index_with_a_malformed_segment_names_the_file(tmp_path: Path) -> None:
    ck = saved(tmp_path, {"w": torch.zeros(4)})
    c = only_chunk(ck)
    rewrite_index(ck, b"PAR1 this is not a segment, but 48 bytes long!! ", nrows=1)
    all_refuse(ck, rf"{index_path(ck).name} segment .*: its first word .* is not the segment magic")
    rewrite_index(ck, b"PAR1 this is not parquet PAR1", nrows=1)
    all_refuse(ck, rf"{index_path(ck).name} segment .*: 29 bytes are not a segment")
    rewrite_index(ck, rows_of(c))
    raw = bytearray(index_path(ck).read_bytes())
    raw[5] ^= 1  # damaged after the directory was written: the checksum tells
    index_path(ck).write_bytes(bytes(raw))
    all_refuse(ck, rf"{index_path(ck).name} segment .*: checksum mismatch")


def test_malformed_json_names_metadata_json(tmp_path: Path) -> None:
    ck = saved(tmp_path)
    for raw in [b"{not json", b'{"format": "bytecp", "format_version": 1, "objects": []}', b"\xff\xfe"]:
        (ck / "metadata.json").write_bytes(raw)
        all_refuse(ck, "metadata.json")


@pytest.mark.timeout(60)
def test_a_terabyte_metadata_json_is_refused_from_its_size_before_it_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A sparse file costs nothing on disk: every reader checks the size first."""
    ck = saved(tmp_path)
    with open(ck / "metadata.json", "r+b") as f:
        f.truncate(1 << 40)
    all_refuse(ck, r"ck: metadata.json is 1,099,511,627,776 bytes, more than the 1,073,741,824 bytecp reads .*"
                   r"If it is a real one, set BYTECP_MAX_METADATA_BYTES above its size")
    assert cli(["verify", str(ck)]) != 0
    assert "metadata.json is 1,099,511,627,776 bytes" in capsys.readouterr().err
    # a real checkpoint above a lowered cap: refused; raised again, it loads
    ck2 = saved(tmp_path / "two")
    size = (ck2 / "metadata.json").stat().st_size
    monkeypatch.setenv("BYTECP_MAX_METADATA_BYTES", str(size - 1))
    all_refuse(ck2, f"metadata.json is {size:,} bytes, more than the {size - 1:,} bytecp reads")
    monkeypatch.setenv("BYTECP_MAX_METADATA_BYTES", str(size))
    assert torch.equal(bytecp.load_state_dict(str(ck2))["w"], torch.arange(6, dtype=torch.float32))
    monkeypatch.setenv("BYTECP_MAX_METADATA_BYTES", "1e9")
    with pytest.raises(ConfigError, match=r"BYTECP_MAX_METADATA_BYTES='1e9' is not a positive whole number of "
                                          r"bytes \(unset it for the default, 1073741824\)"):
        bytecp.load_state_dict(str(ck2))


@pytest.mark.timeout(60)
def test_a_run_folder_with_an_oversized_metadata_json_resumes_from_the_step_before(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bytecp.tools.resume import decide

    run = tmp_path / "run"
    for step in (1, 2):
        bytecp.save(str(run / f"step-{step}"), {"w": torch.full((3,), float(step))}, step=step)
    for holes_only in (False, True):
        # grown to 2 TiB past its JSON (its header still reads), then all of it holes (no header either):
        # a candidate that fails its load, with a warning; the resume takes the step before
        if holes_only:
            (run / "step-2" / "metadata.json").unlink()
        with open(run / "step-2" / "metadata.json", "r+b" if not holes_only else "wb") as f:
            f.truncate(1 << 41)
        assert [c.name for c in decide(str(run)).checkpoints] == ["step-1", "step-2"]
        state = {"w": torch.zeros(3)}
        assert bytecp.CheckpointManager(str(run), every_n_steps=1).restore(state) == 1
        assert torch.equal(state["w"], torch.full((3,), 1.0))
        assert cli(["ls", str(run)]) == 0
        assert "step-1" in capsys.readouterr().out


@pytest.mark.parametrize("cap", ["below its size", "malformed"])
def test_a_failed_saves_cleanup_never_takes_a_committed_oversized_metadata_json_for_another_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: str) -> None:
    """(its first bytes name the save, whatever its size and its user metadata: 100 KB here,
    before the members a header scan needs; the readers' size cap is not the writer's business)"""
    from bytecp.errors import DistributedCheckpointError
    from bytecp.saving.commit import committed_after, remove_failed

    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"w": torch.arange(6, dtype=torch.float32)}, metadata={"notes": "x" * 100_000})
    save_id = md_of(ck)["save_id"]
    size = (ck / "metadata.json").stat().st_size
    monkeypatch.setenv("BYTECP_MAX_METADATA_BYTES", str(size - 1) if cap == "below its size" else "64MiB")
    st = open_storage(str(ck))
    assert remove_failed(st, save_id, 0, coordinator=True) == []
    broke = DistributedCheckpointError("save/commit", {1: "lost"})
    with pytest.warns(UserWarning, match=f"is committed \\(save {save_id}\\)"):
        got = committed_after(st, broke, save_id, None, coordinator=True)
    assert got is not None and got.save_id == save_id
    assert any((ck / "data" / save_id).iterdir())
    # another save's files next to it: removed (its metadata.json names this one)
    (ck / "data" / "other-save").mkdir()
    (ck / "data" / "other-save" / "0-0.bin").write_bytes(b"x")
    assert committed_after(st, broke, "other-save", None, coordinator=True) is None
    assert not (ck / "data" / "other-save").exists()
    monkeypatch.delenv("BYTECP_MAX_METADATA_BYTES")
    assert torch.equal(bytecp.load_state_dict(str(ck))["w"], torch.arange(6, dtype=torch.float32))


def test_a_save_committing_a_metadata_json_above_the_readers_cap_warns_what_loading_it_takes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("BYTECP_MAX_METADATA_BYTES", "100")
    with caplog.at_level("WARNING", logger="bytecp"):
        ck = saved(tmp_path)
    size = (ck / "metadata.json").stat().st_size
    assert f"ck: metadata.json is {size:,} bytes, more than the 100 readers read; loading it takes " \
           f"BYTECP_MAX_METADATA_BYTES={size} or more" in caplog.text
    monkeypatch.setenv("BYTECP_MAX_METADATA_BYTES", str(size))
    assert torch.equal(bytecp.load_state_dict(str(ck))["w"], torch.arange(6, dtype=torch.float32))


def test_compressed_blob_archive_is_not_inflated(tmp_path: Path) -> None:
    """A blob whose zip entries are deflated could inflate to any size: refused."""
    ck = saved(tmp_path, {"w": torch.zeros(4), "o": {"t": (1, float("inf"))}})
    md = md_of(ck)
    name, rec = next((k, v) for k, v in md["objects"].items() if "file" in v)
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", b"\0" * (50 << 20))
    blob = bomb.getvalue()
    assert len(blob) < 100_000
    f = ck / rec["file"]
    raw = bytearray(f.read_bytes())
    raw[rec["byte_offset"] : rec["byte_offset"] + len(blob)] = blob
    f.write_bytes(bytes(raw))
    md["data_files"][rec["file"]] = len(raw)
    rec["nbytes"] = len(blob)
    import crc32c as _crc

    rec["crc32c"] = _crc.crc32c(blob)
    write_md(ck, md)
    with pytest.raises(CorruptCheckpointError, match=rf"object '{name}'.*compressed"):
        bytecp.load_state_dict(str(ck))
    _, problems = verify(open_storage(str(ck)))
    assert any("compressed" in str(p) for p in problems)


@pytest.mark.timeout(60)
def test_symlinked_data_file_is_never_opened(tmp_path: Path) -> None:
    """The link points at a FIFO: following it would block forever, so passing
    proves the open never happened."""
    ck = saved(tmp_path, {"w": torch.zeros(4)})
    (f,) = (ck / "data").rglob("*.bin")
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)
    size = f.stat().st_size
    f.unlink()
    f.symlink_to(fifo)
    md = md_of(ck)
    md["data_files"][next(iter(md["data_files"]))] = size
    for _, fn in readers(ck):
        with pytest.raises(CorruptCheckpointError, match="symbolic link"):
            r = fn()
            if isinstance(r, tuple) and r[1]:  # verify reports instead of raising
                raise CorruptCheckpointError(str(r[1][0]))


@pytest.mark.timeout(60)
def test_fifo_inside_the_checkpoint_is_refused_without_blocking(tmp_path: Path) -> None:
    ck = saved(tmp_path, {"w": torch.zeros(4)})
    (f,) = (ck / "data").rglob("*.bin")
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        bytecp.load_state_dict(str(ck))


def test_symlinked_directory_inside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    ck = saved(tmp_path, {"w": torch.zeros(4)})
    (d,) = (ck / "data").iterdir()
    moved = tmp_path / "elsewhere"
    d.rename(moved)
    d.symlink_to(moved, target_is_directory=True)
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        bytecp.load_state_dict(str(ck))


def test_checkpoint_root_may_be_a_link(tmp_path: Path) -> None:
    ck = saved(tmp_path, {"w": torch.arange(4.0)})
    link = tmp_path / "latest"
    link.symlink_to(ck, target_is_directory=True)
    assert torch.equal(bytecp.load_state_dict(str(link))["w"], torch.arange(4.0))



def test_bad_tensor_tables(tmp_path: Path) -> None:
    """Version 4's tensor table (FORMAT.md §6.2): every column checked before
    a shape is trusted, one line naming the tensor or the column at fault."""
    def table(md: dict) -> dict:
        t = md["tensors"]
        assert set(t) == {"names", "dtypes", "dtype", "ndim", "dims"}, "version 4 writes the table"
        return t

    def dims(t: dict, v: list) -> None:
        t["dims"], t["ndim"] = v, [len(v)]

    cases = [
        (lambda t: dims(t, [-1]), "tensor 'w' a negative dimension -1"),
        (lambda t: dims(t, [1] * 65), "tensor 'w' dtype number 0 of 1 and 65 dimensions"),
        (lambda t: dims(t, ["4"]), "'4' in the tensors' dims, not an integer"),
        (lambda t: dims(t, [True]), "True in the tensors' dims, not an integer"),
        (lambda t: t.update(dtypes=["evil"]), "unknown dtype 'evil'"),
        (lambda t: t.update(dtype=[3]), "tensor 'w' dtype number 3 of 1"),
        (lambda t: t.update(ndim=[3]), "3 dimensions in all but lists 1"),
        (lambda t: t.update(names=["w", "w"], dtype=[0, 0], ndim=[1, 0]), "lists tensor 'w' twice"),
        (lambda t: t.update(names=["w", "v"]), "lists 2 tensor names but 1 dtypes"),
        (lambda t: t.pop("dims"), "without exactly the arrays names, dtypes, dtype, ndim and dims"),
        (lambda t: t.update(dims=[2**70]), "not an integer|out of range"),
    ]
    for mutate, match in cases:
        ck = saved(tmp_path / str(len(os.listdir(tmp_path))))
        md = md_of(ck)
        mutate(table(md))
        write_md(ck, md)
        all_refuse(ck, match)
