"""Seeded mutation fuzzing of golden checkpoints against every reader.

Each case copies a small golden checkpoint (tests/golden/v1 and v2), mutates
one of its files -- metadata.json (values set to hostile sizes, keys removed,
deep nesting, raw byte damage), the index (version 1: rows rewritten with
hostile sizes, shapes agreeing with metadata.json, raw byte damage; version
2: a segment's rows rewritten, with the directory's size and checksum
updated as a crafted checkpoint would, or raw damage the checksum catches) or a data
file (bytes flipped, truncated, extended, replaced by a link out of the
checkpoint) -- and runs ``load_state_dict``, ``inspect`` and ``verify``.
Each must succeed or raise a :class:`~bytecp.errors.BytecpError`; none may
raise anything else, allocate beyond the budget (peak resident memory per
case, and an address-space limit that turns a runaway allocation into an
error), or hang (the test's timeout).
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import resource
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import bytecp
from bytecp.errors import BytecpError
from bytecp.format import index_read
from bytecp.format import metadata as fmt
from bytecp.format.checksum import crc32c as crc32c_of
from bytecp.format.index_schema import INDEX_SCHEMA_V2
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import summarize, verify

from .helpers import as_object_form, tensor_specs

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SOURCES = ["v1/plain", "v1/two_ranks", "v1/irregular", "v2/plain", "v2/two_ranks", "v2/irregular", "v2/tied"]
#: 400 cases in the suite (each mutator of each golden source many times over); a
#: long run: BYTECP_FUZZ_CASES=20000 (and BYTECP_FUZZ_SEED for another draw)
CASES = int(os.environ.get("BYTECP_FUZZ_CASES", "400"))
#: resident memory a case may add on top of the reader's steady state
RSS_ALLOWANCE = 64 << 20
HUGE = [-1, -4096, 0, 1, 4095, 10**6, 2**31, 10**12, 2**62, 2**63 - 1, 10**15]
HOSTILE: list[Any] = [*HUGE, 1.5, float("1e308"), "x", "", "../../etc/passwd", None, True, [], {}, [10**12], [[1]], {"json": 1}]


def _files(case: str) -> dict[str, bytes]:
    root = GOLDEN / case / "checkpoint"
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _pick_path(rng: random.Random, node: Any) -> list[Any]:
    """A random path (keys/indices) into a JSON tree, stopping at a random depth."""
    path: list[Any] = []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.8:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    return path


def _set(tree: Any, path: list[Any], value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _deep(depth: int) -> str:
    return '{"l": [' * depth + '{"obj": "x"}' + "]}" * depth


def mutate_metadata(rng: random.Random, files: dict[str, bytes]) -> str:
    raw = files["metadata.json"]
    md = json.loads(raw)
    op = rng.randrange(7)
    if op == 0:  # any value somewhere becomes hostile
        path = _pick_path(rng, md)
        if not path:
            path = [rng.choice(list(md))]
        value = copy.deepcopy(rng.choice(HOSTILE))
        _set(md, path, value)
        desc = f"metadata {path} = {value!r:.40}"
    elif op == 1:  # a key disappears
        path = _pick_path(rng, md) or [rng.choice(list(md))]
        parent = md
        for k in path[:-1]:
            parent = parent[k]
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
        desc = f"metadata del {path}"
    elif op == 2:  # a tensor's shape grows (the index no longer agrees)
        fqn = rng.choice(list(as_object_form(md)))
        shape = md["tensors"][fqn]["shape"] or [1]
        shape[rng.randrange(len(shape))] = rng.choice(HUGE)
        md["tensors"][fqn]["shape"] = shape
        desc = f"metadata shape of {fqn} = {shape}"
    elif op == 3:  # a data file's declared size
        f = rng.choice(list(md["data_files"]))
        md["data_files"][f] = rng.choice(HUGE)
        desc = f"metadata data_files[{f}] = {md['data_files'][f]}"
    elif op == 4:  # an object record's place or size
        recs = [r for r in md["objects"].values() if "file" in r]
        recs += [r for v in md.get("per_rank", {}).values() for r in v.values() if "file" in r]
        if not recs:
            return mutate_bytes(rng, files, "metadata.json")
        rec = rng.choice(recs)
        key = rng.choice(["byte_offset", "nbytes", "file", "pickle", "crc32c"])
        rec[key] = rng.choice(HOSTILE)
        desc = f"metadata object record {key} = {rec[key]!r:.40}"
    elif op == 5:  # deep nesting (beyond the budget, and beyond json's own recursion)
        depth = rng.choice([257, 1000, 100_000])
        md["skeleton"] = "@@"
        files["metadata.json"] = json.dumps(md).replace('"@@"', _deep(depth)).encode()
        return f"metadata skeleton nested {depth} deep"
    else:
        return mutate_bytes(rng, files, "metadata.json")
    files["metadata.json"] = json.dumps(md).encode()
    return desc


def mutate_index(rng: random.Random, files: dict[str, bytes]) -> str:
    name = rng.choice([f for f in files if f.startswith("index/")])
    if name.endswith("index.bin"):
        return mutate_segments(rng, files, name)
    if rng.random() < 0.5:
        return mutate_bytes(rng, files, name)
    chunks = index_read.read_index([(name, files[name])])
    i = rng.randrange(len(chunks))
    c = chunks[i]
    field = rng.choice(["global_shape", "offsets", "lengths", "byte_offset", "nbytes", "file", "dtype", "consistent"])
    big = rng.choice(HUGE)
    if field in ("byte_offset", "nbytes"):
        c = fmt.ChunkRecord(**{**c.__dict__, field: max(min(big, 2**63 - 1), -(2**63))})
    elif field in ("global_shape", "offsets", "lengths"):
        dims = list(getattr(c, field)) or [0]
        if rng.random() < 0.2:
            dims = dims * rng.choice([2, 100, 5000])
        else:
            dims[rng.randrange(len(dims))] = max(min(big, 2**63 - 1), -(2**63))
        c = fmt.ChunkRecord(**{**c.__dict__, field: tuple(dims)})
    elif field == "file":
        c = fmt.ChunkRecord(**{**c.__dict__, "file": rng.choice(["data/x/0-0.bin", "../metadata.json", "index/a/0.parquet", c.file + "x"])})
    elif field == "dtype":
        c = fmt.ChunkRecord(**{**c.__dict__, "dtype": rng.choice(["float64", "int8", "bogus", ""])})
    else:  # metadata.json, the index and data_files agree on a huge tensor
        n = rng.choice([10**9, 10**12, 2**40])
        md = json.loads(files["metadata.json"])
        itemsize = 8 if "64" in c.dtype else 4
        as_object_form(md)[c.fqn]["shape"] = [n]
        md["data_files"][c.file] = c.byte_offset + n * itemsize
        files["metadata.json"] = json.dumps(md).encode()
        chunks = [x for x in chunks if x.fqn != c.fqn]
        c = fmt.ChunkRecord(c.fqn, c.dtype, (n,), (0,), (n,), c.file, c.byte_offset, n * itemsize, c.crc32c)
        chunks.append(c)
        files[name] = fmt.write_index(chunks)
        return f"consistent huge tensor {c.fqn} of {n} elements"
    chunks[i] = c
    files[name] = fmt.write_index(chunks)
    return f"index {name} row {i} {field} -> {getattr(c, field)!r:.60}"


def mutate_segments(rng: random.Random, files: dict[str, bytes], name: str) -> str:
    """Version 2: damage the index file, or rewrite one segment's rows (and,
    as a crafted checkpoint would, the directory's size and checksum)."""
    md = json.loads(files["metadata.json"])
    d = md["index"]
    segs = [(col, k) for col in (d["band"], d["wide"]) for k in range(len(col["offset"]))]
    col, k = rng.choice(segs)
    off, n = col["offset"][k], col["nbytes"][k]
    raw = files[name]
    op = rng.random()
    if op < 0.3:  # raw damage, the directory left as it was: the checksum tells
        return mutate_bytes(rng, files, name)
    table = pq.ParquetFile(pa.BufferReader(raw[off : off + n])).read(use_threads=False).cast(INDEX_SCHEMA_V2)
    rows = table.to_pylist()
    i = rng.randrange(len(rows))
    field = rng.choice(["offsets", "lengths", "byte_offset", "nbytes", "file", "fqn", "duplicate", "raw"])
    big = max(min(rng.choice(HUGE), 2**63 - 1), -(2**63))
    if field in ("byte_offset", "nbytes"):
        rows[i][field] = big
    elif field in ("offsets", "lengths"):
        dims = list(rows[i][field]) or [0]
        dims = dims * rng.choice([2, 100, 5000]) if rng.random() < 0.2 else dims
        dims[rng.randrange(len(dims))] = big
        rows[i][field] = dims
    elif field == "file":
        rows[i]["file"] = rng.choice(["data/x/0-0.bin", "../metadata.json", "index/a/index.bin", rows[i]["file"] + "x"])
    elif field == "fqn":
        rows[i]["fqn"] = rng.choice(["nope", "", rows[i]["fqn"] + ".x", *tensor_specs(md)])
    elif field == "duplicate":
        rows.append(dict(rows[i], lengths=[max(1, x) for x in rows[i]["lengths"]]))
    cols = {f.name: [r[f.name] for r in rows] for f in INDEX_SCHEMA_V2}
    seg = rng.randbytes(rng.choice([10, 100])) if field == "raw" else _encode(cols)
    files[name] = raw[:off] + seg + raw[off + n :]
    shift = len(seg) - n
    for c in (d["band"], d["wide"]):
        c["offset"] = [o + shift if o > off else o for o in c["offset"]]
    col["nbytes"][k], col["crc32c"][k] = len(seg), crc32c_of(seg)
    if rng.random() < 0.8:
        col["rows"][k] = len(rows)
    d["nbytes"] = len(files[name])
    files["metadata.json"] = json.dumps(md).encode()
    return f"index segment {k} row {i} {field} -> {rows[i].get(field, '')!r:.60} (directory updated)"


def _encode(cols: dict[str, list[Any]]) -> bytes:
    sink = io.BytesIO()
    try:
        pq.write_table(pa.table(cols, schema=INDEX_SCHEMA_V2), sink)
    except (pa.ArrowException, OverflowError, TypeError):
        return b"PAR1 not parquet PAR1"
    return sink.getvalue()


def mutate_data(rng: random.Random, files: dict[str, bytes]) -> str:
    name = rng.choice([f for f in files if f.startswith("data/")])
    if rng.random() < 0.05:
        files[name] = b"@symlink:/etc/passwd"
        return f"data {name} -> symlink to /etc/passwd"
    return mutate_bytes(rng, files, name)


def mutate_bytes(rng: random.Random, files: dict[str, bytes], name: str) -> str:
    raw = bytearray(files[name])
    op = rng.randrange(5)
    if op == 0 and raw:
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        desc = "bits flipped"
    elif op == 1:
        raw = raw[: rng.randrange(len(raw) + 1)]
        desc = f"truncated to {len(raw)}"
    elif op == 2:
        raw += rng.randbytes(rng.choice([1, 100, 5000]))
        desc = "extended"
    elif op == 3 and raw:
        a = rng.randrange(len(raw))
        b = min(len(raw), a + rng.randint(1, 512))
        raw[a:b] = rng.randbytes(b - a)
        desc = f"bytes {a}..{b} randomized"
    else:
        raw = bytearray()
        desc = "emptied"
    files[name] = bytes(raw)
    return f"{name} {desc}"


MUTATORS: list[Callable[[random.Random, dict[str, bytes]], str]] = [mutate_metadata, mutate_index, mutate_data]


def write(root: Path, files: dict[str, bytes]) -> None:
    if root.exists():
        shutil.rmtree(root)
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if data.startswith(b"@symlink:"):
            p.symlink_to(data[len(b"@symlink:") :].decode())
        else:
            p.write_bytes(data)


def run_readers(root: Path) -> list[tuple[str, str]]:
    """(reader, outcome) for every reader; outcome 'ok', 'bytecp:<Error>' or 'OTHER:<traceback>'."""
    st = open_storage(str(root))
    out = []
    for name, fn in (
        ("load_state_dict", lambda: bytecp.load_state_dict(str(root), io_threads=2)),
        ("inspect", lambda: summarize(st)),
        ("verify", lambda: verify(st, io_threads=2)),
    ):
        try:
            fn()
            out.append((name, "ok"))
        except BytecpError as e:
            out.append((name, f"bytecp:{type(e).__name__}"))
        except BaseException:  # noqa: BLE001 - exactly what the fuzz looks for
            out.append((name, "OTHER:" + traceback.format_exc(limit=6)))
    return out


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak resident set) to the current RSS
        return True
    except OSError:
        return False


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mutated_checkpoints_fail_with_bytecp_errors_within_budget(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("BYTECP_FUZZ_SEED", "20261123")))
    golden = {case: _files(case) for case in SOURCES}
    # steady state: every reader once on each pristine checkpoint
    for case, files in golden.items():
        write(tmp_path / "ck", files)
        assert all(o == "ok" for _, o in run_readers(tmp_path / "ck")), case
    per_case_peak = _reset_peak()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    # a runaway allocation (GBs) fails instead of succeeding lazily
    limit = _status("VmSize") + (3 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    failures: list[str] = []
    outcomes: dict[str, int] = {}
    worst_rss = 0
    t0 = time.monotonic()
    slowest = 0.0
    try:
        for i in range(CASES):
            case = rng.choice(SOURCES)
            files = dict(golden[case])
            desc = rng.choice(MUTATORS)(rng, files)
            root = tmp_path / "ck"
            write(root, files)
            ck_bytes = sum(len(b) for b in files.values())
            base = _status("VmRSS")
            if per_case_peak:
                _reset_peak()
            c0 = time.monotonic()
            results = run_readers(root)
            slowest = max(slowest, time.monotonic() - c0)
            grew = (_status("VmHWM") if per_case_peak else _status("VmRSS")) - base
            worst_rss = max(worst_rss, grew)
            for reader, outcome in results:
                key = "OTHER" if outcome.startswith("OTHER") else outcome
                outcomes[key] = outcomes.get(key, 0) + 1
                if outcome.startswith("OTHER"):
                    failures.append(f"case {i} ({case}: {desc}) {reader}:\n{outcome}")
            if grew > ck_bytes + RSS_ALLOWANCE:
                failures.append(f"case {i} ({case}: {desc}): resident memory grew {grew >> 20} MiB")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    elapsed = time.monotonic() - t0
    print(f"{CASES} cases in {elapsed:.1f} s (slowest {slowest:.2f} s), worst RSS growth {worst_rss >> 20} MiB")
    print(json.dumps(outcomes, indent=1, sort_keys=True))
    assert not failures, "\n\n".join(failures[:10]) + f"\n\n({len(failures)} failures)"
    # the mutations reach the checks (not only parse errors), and many cases still load
    assert outcomes.get("ok", 0) > 0
    assert len([k for k in outcomes if k.startswith("bytecp:")]) >= 3


def test_a_damaged_parquet_index_is_named_on_one_line(tmp_path: Path) -> None:
    """A format-1 index file (Parquet) damaged in its footer: pyarrow's message ends in a newline,
    and the error quoting it stays one line naming the file (the load's and the CLI's)."""
    src = Path(__file__).parents[1] / "golden" / "v1" / "irregular" / "checkpoint"
    url = tmp_path / "ck"
    shutil.copytree(src, url)
    index = next(url.glob("index/*/0.parquet"))
    raw = bytearray(index.read_bytes())
    raw[1804:1812] = b"\xff" * 7 + b"\x7f"  # (a thrift length in the footer made negative)
    index.write_bytes(bytes(raw))
    with pytest.raises(BytecpError) as ei:
        bytecp.load_state_dict(str(url))
    message = str(ei.value)
    assert "\n" not in message and index.name in message and "unreadable" in message, message


def test_a_null_band_dim_is_no_band_and_a_foreign_rng_value_is_refused_by_name(tmp_path: Path) -> None:
    """Crafted metadata.json values that reached raw exceptions: a format-1 tensor entry's
    ``"band_dim": null`` is no band dimension, as every other reader of it takes it (the load and
    ``verify`` pass, bitwise), and an RNGState's per-rank record that is JSON but no RNG state is a
    one-line ``CorruptCheckpointError`` naming RNGState, the generators left as they were."""
    src = Path(__file__).parents[1] / "golden" / "v1" / "irregular" / "checkpoint"
    url = tmp_path / "v1"
    shutil.copytree(src, url)
    want = bytecp.load_state_dict(str(url))
    md = json.loads((url / "metadata.json").read_text())
    fqn = next(iter(md["tensors"]))
    md["tensors"][fqn]["band_dim"] = None
    (url / "metadata.json").write_text(json.dumps(md))
    got = bytecp.load_state_dict(str(url))
    assert got.keys() == want.keys() and all(  # bitwise (NaNs included)
        torch.equal(got[k].flatten().view(torch.uint8), v.flatten().view(torch.uint8)) for k, v in want.items())
    from bytecp.cli import main as cli
    assert cli(["verify", str(url)]) == 0

    rng = tmp_path / "rng"
    bytecp.save(str(rng), {"w": torch.ones(2), "rng": bytecp.RNGState()})
    md = json.loads((rng / "metadata.json").read_text())
    md["per_rank"]["rng"]["0"] = {"json": {"a": 1}}
    (rng / "metadata.json").write_text(json.dumps(md))
    before = torch.get_rng_state()
    with pytest.raises(bytecp.CorruptCheckpointError, match="^RNGState: the checkpoint's value is not") as ei:
        bytecp.load(str(rng), {"w": torch.zeros(2), "rng": bytecp.RNGState()})
    assert "\n" not in str(ei.value) and torch.equal(torch.get_rng_state(), before)
