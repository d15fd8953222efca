"""A reader of bytecp checkpoints written from docs/FORMAT.md alone, using only
json, struct, pyarrow, crc32c, numpy and torch: versions 1 to 5, every check the
spec asks of a reader, plus the reference writer's own choices where the
golden files can show them (no gaps between segments, zero padding).
``spec_read`` returns the state and the per-rank values; ``v4_lookup``
follows §5.6's lookup for one box.
"""

from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ALIGNMENT = 4096


INDEX_TYPES = {
    "fqn": pa.string(),
    "offsets": pa.list_(pa.int64()),
    "lengths": pa.list_(pa.int64()),
    "file": pa.string(),
    "byte_offset": pa.int64(),
    "nbytes": pa.int64(),
    "crc32c": pa.uint32(),
}
V1_TYPES = {"dtype": pa.string(), "global_shape": pa.list_(pa.int64())}


def spec_index_rows(root: Path, md: dict[str, Any]) -> list[dict[str, Any]]:
    """Every chunk row, each once: version 1's index files (§5.5), version
    2's and 3's segments found through the directory (§5.3, §5.4), or
    version 4's parts found through theirs (§5.6)."""
    if md["format_version"] >= 4:
        rows, entries = v4_rows(root, md)
        for row in rows:  # §5.6's lookup for a row's own box finds the entry listing it
            assert row["entry"] in v4_lookup(md, entries, row["fqn"], row), row
        return [{k: v for k, v in row.items() if k != "entry"} for row in rows]
    if md["format_version"] == 1:
        tables = [pq.ParquetFile(root / f).read(use_threads=False) for f in md["index_files"]]
        types = INDEX_TYPES | V1_TYPES
    else:
        assert md["index_files"] == []
        d = md["index"]
        raw = (root / d["file"]).read_bytes()
        assert len(raw) == d["nbytes"]
        tables, spans = [], []
        for col in (d["band"], d["wide"]):
            for off, n, rows, crc in zip(col["offset"], col["nbytes"], col["rows"], col["crc32c"], strict=True):
                seg = raw[off : off + n]
                assert seg[:4] == seg[-4:] == b"PAR1" and crc32c.crc32c(seg) == crc
                tables.append(pq.ParquetFile(io.BytesIO(seg)).read(use_threads=False))
                assert tables[-1].num_rows == rows
                spans.append((off, n))
        spans.sort()
        assert [o for o, _ in spans] == [0, *[o + n for o, n in spans[:-1]]] and sum(n for _, n in spans) == len(raw)
        assert d["band"]["bucket"] == sorted(set(d["band"]["bucket"]))
        types = INDEX_TYPES
    rows, seen = [], set()
    for table in tables:
        # version 3 keeps version 2's index: its segments say "2"
        assert table.schema.metadata[b"bytecp.format_version"] == str(min(md["format_version"], 2)).encode()
        for name, typ in types.items():
            got = table.schema.field(name).type
            assert (got.value_type if pa.types.is_dictionary(got) else got) == typ, name
        for row in table.to_pylist():
            key = json.dumps(row, sort_keys=True)
            if key not in seen:  # version 2 lists a chunk in each band it meets
                seen.add(key)
                rows.append(row)
    if md["format_version"] >= 2:  # each chunk is in the segments its box names (§5.4)
        d = md["index"]
        for row in rows:
            info = md["tensors"][row["fqn"]]
            assert math.prod(row["lengths"]) > 0
            if "band_dim" in info:
                k, size = info["band_dim"], info["shape"][info["band_dim"]]
                o, n = row["offsets"][k], row["lengths"][k]
                for b in range(o * d["buckets"] // size, (o + n - 1) * d["buckets"] // size + 1):
                    assert b in d["band"]["bucket"], (row["fqn"], b)
            else:
                assert any(f <= row["fqn"] <= la for f, la in zip(d["wide"]["first"], d["wide"]["last"], strict=True))
    return rows


def spec_metadata(raw: bytes) -> dict[str, Any]:
    """metadata.json, its version-4 tensor table (FORMAT.md §6.2) turned into
    the object form ``{fqn: {"dtype", "shape"}}`` the rest of this reader uses."""
    md: dict[str, Any] = json.loads(raw)
    t = md["tensors"]
    if md["format_version"] >= 4 and set(t) == {"names", "dtypes", "dtype", "ndim", "dims"}:
        assert len(t["names"]) == len(set(t["names"])) == len(t["dtype"]) == len(t["ndim"])
        assert sum(t["ndim"]) == len(t["dims"])
        specs, pos = {}, 0
        for name, d, n in zip(t["names"], t["dtype"], t["ndim"], strict=True):
            specs[name] = {"dtype": t["dtypes"][d], "shape": t["dims"][pos : pos + n]}
            pos += n
        md["tensors"] = specs
    return md


def spec_read(root: Path, *, allow_pickle: bool = False) -> Any:
    """Read a format-v1 to v5 checkpoint following docs/FORMAT.md, without bytecp.
    Version 3's references (``../<checkpoint>/data/...``) are read from the
    sibling checkpoint, which must be committed and hold that save."""
    md = spec_metadata((root / "metadata.json").read_bytes())
    assert md["format"] == "bytecp" and md["format_version"] in (1, 2, 3, 4, 5)
    for name, save_id in md.get("references", {}).items():
        assert md["format_version"] >= 3 and "/" not in name and name not in (".", "..")
        base = root.parent / name
        meta = base / "metadata.json" if (base / "metadata.json").exists() else base / "base.json"
        assert json.loads(meta.read_bytes())["save_id"] == save_id
    for f, size in md["data_files"].items():
        if f.startswith("../"):
            assert f.split("/")[1] in md["references"] and f.split("/")[3] == md["references"][f.split("/")[1]]
        assert (root / f).stat().st_size == size, f
        assert size % ALIGNMENT == 0, f"{f}: the writer pads every chunk, the last one too"
    data = {f: (root / f).read_bytes() for f in md["data_files"]}

    def itemsize(name: str) -> int:
        return torch.empty((), dtype=getattr(torch, name)).element_size()

    out: dict[str, bytearray] = {}
    seen: dict[str, np.ndarray] = {}
    for fqn, info in md["tensors"].items():
        out[fqn] = bytearray(math.prod(info["shape"]) * itemsize(info["dtype"]))
        seen[fqn] = np.zeros(info["shape"], dtype=np.int8)
    used: dict[str, list[tuple[int, int]]] = {f: [] for f in data}
    for row in spec_index_rows(root, md):
        info = md["tensors"][row["fqn"]]
        if md["format_version"] == 1:
            assert row["dtype"] == info["dtype"] and row["global_shape"] == info["shape"]
        offs, lens = row["offsets"], row["lengths"]
        assert len(offs) == len(lens) == len(info["shape"])
        size = itemsize(info["dtype"])
        assert row["nbytes"] == math.prod(lens) * size
        assert row["byte_offset"] % ALIGNMENT == 0
        blob = data[row["file"]][row["byte_offset"] : row["byte_offset"] + row["nbytes"]]
        assert len(blob) == row["nbytes"] and crc32c.crc32c(blob) == row["crc32c"]
        if md["format_version"] >= 5:  # §8: the crc32c of each block of a chunk over one block
            bb = md["index"]["block_bytes"]
            assert row["blocks"] == ([crc32c.crc32c(blob[k : k + bb]) for k in range(0, len(blob), bb)]
                                     if len(blob) > bb else []), row["fqn"]
        used[row["file"]].append((row["byte_offset"], row["nbytes"]))
        box = tuple(slice(o, o + n) for o, n in zip(offs, lens, strict=True))
        whole = np.frombuffer(out[row["fqn"]], dtype=np.uint8).reshape(*info["shape"], size)
        whole[box] = np.frombuffer(blob, dtype=np.uint8).reshape(*lens, size)
        seen[row["fqn"]][box] += 1
    for fqn, s in seen.items():
        assert (s == 1).all(), f"{fqn}: chunks do not cover it exactly once"

    def read_object(rec: dict[str, Any]) -> Any:
        if "json" in rec:
            return rec["json"]
        blob = data[rec["file"]][rec["byte_offset"] : rec["byte_offset"] + rec["nbytes"]]
        assert rec["byte_offset"] % ALIGNMENT == 0 and crc32c.crc32c(blob) == rec["crc32c"]
        used[rec["file"]].append((rec["byte_offset"], rec["nbytes"]))
        if rec["pickle"] and not allow_pickle:
            raise PermissionError("needs allow_pickle")
        return torch.load(io.BytesIO(blob), weights_only=not rec["pickle"])

    objects = {k: read_object(r) for k, r in md["objects"].items()}
    per_rank = {
        k: {int(r): read_object(rec) for r, rec in v.items()} for k, v in md["per_rank"].items()
    }
    # everything between the stored items is zero padding
    for f, spans in used.items():
        if f.startswith("../"):
            continue  # a referenced file holds boxes of the base that this checkpoint does not read
        buf = data[f]
        spans.sort()
        pos = 0
        for off, n in spans:
            assert off >= pos and not any(buf[pos:off]), f"{f}: non-zero bytes at {pos}..{off}"
            pos = off + n
        assert not any(buf[pos:]), f"{f}: non-zero bytes after the last item"

    def tensor(fqn: str) -> torch.Tensor:
        info = md["tensors"][fqn]
        dtype = getattr(torch, info["dtype"])
        if not out[fqn]:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(out[fqn], dtype=torch.uint8).view(dtype).reshape(info["shape"])

    def build(node: Any, fqn: str = "") -> Any:
        def at(key: Any) -> str:  # the FQN of a child (FORMAT.md §6.5)
            return f"{fqn}.{key}" if fqn else str(key)

        if isinstance(node, str):  # version 4: a leaf named by its position's FQN (§6.4)
            return build({{"T": "tensor", "O": "obj", "R": "rank"}[node]: fqn}, fqn)
        if set(node) == {"k", "v"}:  # version 4: a dict as its keys and its nodes
            assert len(node["k"]) == len(node["v"])
            return {k: build(child, at(k)) for k, child in zip(node["k"], node["v"], strict=True)}
        ((kind, body),) = node.items()
        if kind == "d":
            return {k: build(child, at(k)) for k, child in body}
        if kind == "l":
            return [build(child, at(i)) for i, child in enumerate(body)]
        if kind == "t":
            return tuple(build(child, at(i)) for i, child in enumerate(body))
        if kind == "tensor":  # an alias reads the tensor it names (FORMAT.md §6.6)
            return tensor(md.get("aliases", {}).get(body, body))
        if kind == "obj":
            return objects[body]
        if kind == "rank":
            return per_rank[body][0]
        raise AssertionError(f"unknown skeleton node {node!r}")

    return build(md["skeleton"]), per_rank


# ----------------------------------------------------------------- version 4 (FORMAT.md §5.6)
BAND_TYPES = {"lo": pa.int64(), "hi": pa.int64()}
WIDE_TYPES = {"first": pa.string(), "last": pa.string()}
ENTRY_TYPES = {"rank": pa.int64(), "offset": pa.int64(), "nbytes": pa.int64(), "rows": pa.int64(),
               "crc32c": pa.uint32()}


def _parquet(buf: bytes, off: int, n: int, crc: int, rows: int, save_id: str, types: dict[str, Any]) -> pa.Table:
    """A page or segment at ``off``: inside ``buf``, its CRC-32C, its rows,
    its columns and its schema metadata (format version 4, this save)."""
    assert off >= 0 and n > 0 and off + n <= len(buf), (off, n, len(buf))
    blob = buf[off : off + n]
    assert blob[:4] == blob[-4:] == b"PAR1" and crc32c.crc32c(blob) == crc
    table = pq.ParquetFile(io.BytesIO(blob)).read(use_threads=False)
    assert table.num_rows == rows
    meta = table.schema.metadata
    assert meta[b"bytecp.format_version"] == b"4" and meta[b"bytecp.save_id"] == save_id.encode()
    for name, typ in types.items():
        got = table.schema.field(name).type
        assert (got.value_type if pa.types.is_dictionary(got) else got) == typ, name
    return table


#: a version-4 part segment's first word: the bytes "bcpSG4" then 0x00 0x01 (FORMAT.md §5.6); version 5's
#: (encoding 2, with block checksums): 0x00 0x02
SEGMENT_MAGIC = b"bcpSG4\x00\x01"
SEGMENT_MAGIC_5 = b"bcpSG4\x00\x02"
MAX_NDIM = 64


def read_segment(buf: bytes, off: int, n: int, crc: int, rows: int, save_id: str,
                 block_bytes: int | None = None) -> list[dict[str, Any]]:
    """A version-4 or -5 part segment at ``off`` (§5.6, "Segment encoding"):
    inside ``buf``, its CRC-32C, then every check a reader MUST make of its
    words, each count against the segment's length before it is used.
    ``block_bytes``: version 5's (encoding 2). -> its rows as dicts of the
    §5.3 columns (version 5: and ``blocks``, each row's block checksums)."""
    assert off >= 0 and n > 0 and off + n <= len(buf), (off, n, len(buf))
    blob = buf[off : off + n]
    assert crc32c.crc32c(blob) == crc
    h = 6 if block_bytes is None else 7
    assert n % 8 == 0 and n >= 8 * h, n
    word = lambda k: struct.unpack_from("<q", blob, 8 * k)[0]  # noqa: E731
    assert blob[:8] == (SEGMENT_MAGIC if block_bytes is None else SEGMENT_MAGIC_5)
    nrows, m, f, dims, nstr = (word(k) for k in range(1, 6))
    nblocks = 0 if block_bytes is None else word(6)
    assert min(nrows, m, f, dims, nstr, nblocks) >= 0 and nrows == rows
    blocks_at = h + 6 * nrows + 2 * dims
    strings_at = blocks_at + (nblocks + 1) // 2 + 1 + m + f
    assert 8 * strings_at + (nstr + 7) // 8 * 8 == n, "no byte past the padded strings"
    cols = [[word(h + c * nrows + i) for i in range(nrows)] for c in range(6)]
    name_id, file_id, ndim, byte_offset, nbytes, crcs = cols
    offsets = [word(h + 6 * nrows + i) for i in range(dims)]
    lengths = [word(h + 6 * nrows + dims + i) for i in range(dims)]
    sums = list(struct.unpack_from(f"<{nblocks}I", blob, 8 * blocks_at))
    assert nblocks % 2 == 0 or struct.unpack_from("<I", blob, 8 * blocks_at + 4 * nblocks)[0] == 0, "zero padding"
    per = [0 if block_bytes is None or b <= block_bytes else -(-b // block_bytes) for b in nbytes]
    assert sum(per) == nblocks, "one block checksum per block of each chunk over one block"
    lens = [word(blocks_at + (nblocks + 1) // 2 + i) for i in range(1 + m + f)]
    assert all(0 <= k <= MAX_NDIM for k in ndim) and sum(ndim) == dims
    assert all(0 <= i < m for i in name_id) and all(0 <= i < f for i in file_id)
    assert all(x >= 0 for x in byte_offset + nbytes + offsets + lengths) and all(0 <= c < 2**32 for c in crcs)
    assert all(0 <= k <= nstr for k in lens) and sum(lens) == nstr
    tail = blob[8 * strings_at :]
    assert tail[nstr:] == bytes(len(tail) - nstr), "zero padding"
    strings, pos = [], 0
    for k in lens:
        strings.append(tail[pos : pos + k].decode("utf-8"))  # strict: not UTF-8 raises
        pos += k
    assert strings[0] == save_id
    names, files = strings[1 : 1 + m], strings[1 + m :]
    assert all(a < b for a, b in zip(names, names[1:], strict=False)), "names strictly ascending"
    out, at, bat = [], 0, 0
    for i in range(nrows):
        out.append({"fqn": names[name_id[i]], "offsets": offsets[at : at + ndim[i]],
                    "lengths": lengths[at : at + ndim[i]], "file": files[file_id[i]], "byte_offset": byte_offset[i],
                    "nbytes": nbytes[i], "crc32c": crcs[i]})
        if block_bytes is not None:
            out[-1]["blocks"] = sums[bat : bat + per[i]]
        at += ndim[i]
        bat += per[i]
    return out


def row_bands(row: dict[str, Any], shape: list[int], buckets: int) -> tuple[int, int]:
    """The bands ``lo..hi`` a row (or box) meets: its first and last
    elements' row-major indices times B over the tensor's size."""
    n = math.prod(shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    f = sum(o * s for o, s in zip(row["offsets"], strides, strict=True))
    last = sum((o + k - 1) * s for o, k, s in zip(row["offsets"], row["lengths"], strides, strict=True))
    return f * buckets // n, last * buckets // n


def v4_rows(root: Path, md: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every row of a version-4 index, each with the entry listing it
    (``row["entry"]``: for a row of a scalar page, that page as
    ``{"kind": "scalar", "page": k, "first", "last"}``), and every directory
    entry (``kind`` added) and scalar page, in directory order."""
    d, sid = md["index"], md["save_id"]
    assert d["layout"] == "parts" and md["index_files"] == []
    v5 = md["format_version"] >= 5
    assert set(d) == {"layout", "buckets", "parts", "directory", "band_pages", "wide_pages", "scalar_pages",
                      *(("block_bytes",) if v5 else ())}
    block_bytes = d["block_bytes"] if v5 else None
    assert block_bytes is None or (4096 <= block_bytes <= 2**30 and block_bytes & (block_bytes - 1) == 0)
    buckets = d["buckets"]
    limit = max(8, buckets // 64)
    assert 1 <= buckets <= 2**18
    assert d["directory"]["file"] == f"index/{sid}/directory.bin"
    raw = (root / d["directory"]["file"]).read_bytes()
    assert len(raw) == d["directory"]["nbytes"]
    ranks, sizes = d["parts"]["rank"], d["parts"]["nbytes"]
    assert all(a < b for a, b in zip(ranks, ranks[1:], strict=False)) and all(n > 0 for n in sizes)
    size_of = dict(zip(ranks, sizes, strict=True))
    parts = {r: (root / f"index/{sid}/{r}.bin").read_bytes() for r in ranks}
    entries: list[dict[str, Any]] = []
    page_spans = []
    rows, seen = [], set()

    def add(row: dict[str, Any], entry: dict[str, Any]) -> None:
        key = json.dumps(row, sort_keys=True)
        assert key not in seen, "each chunk is listed exactly once"
        seen.add(key)
        rows.append({**row, "entry": entry})

    for kind, a, b, types in (("band", "lo", "hi", BAND_TYPES | ENTRY_TYPES), ("wide", "first", "last",
                              WIDE_TYPES | ENTRY_TYPES), ("scalar", "first", "last", INDEX_TYPES)):
        col = d[f"{kind}_pages"]
        assert set(col) == {a, b, "offset", "nbytes", "rows", "crc32c"}
        assert len({len(v) for v in col.values()}) == 1 and col[a] == sorted(col[a])
        prev = None
        for k in range(len(col[a])):
            page = _parquet(raw, col["offset"][k], col["nbytes"][k], col["crc32c"][k], col["rows"][k], sid, types)
            page_spans.append((col["offset"][k], col["nbytes"][k]))
            if kind == "scalar":  # rows of 0-dim chunks, each tensor once, by name, inside the page's names
                here = {"kind": "scalar", "page": k, "first": col[a][k], "last": col[b][k]}
                for row in page.to_pylist():
                    assert md["tensors"][row["fqn"]]["shape"] == [] and row["offsets"] == row["lengths"] == []
                    if v5:  # a 0-dim chunk is never over one block
                        row["blocks"] = []
                    assert col[a][k] <= row["fqn"] <= col[b][k] and (prev is None or prev < row["fqn"]), row
                    prev = row["fqn"]
                    add(row, here)
                entries.append(here)
                continue
            for e in page.to_pylist():
                assert col[a][k] <= e[a] <= e[b] <= col[b][k], (kind, k, e)
                assert prev is None or prev <= (e[a], e["rank"]), "entries sorted by (lo|first, rank)"
                prev = (e[a], e["rank"])
                assert kind == "wide" or 0 <= e["lo"] <= e["hi"] < buckets
                assert e["rank"] in size_of and e["rows"] > 0
                assert e["offset"] >= 0 and e["nbytes"] > 0 and e["offset"] + e["nbytes"] <= size_of[e["rank"]]
                entries.append({**e, "kind": kind})
    _no_overlap(page_spans, len(raw), tile=True)  # the reference writer leaves no gap
    segments: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in entries:
        if e["kind"] != "scalar":
            segments.setdefault((e["rank"], e["offset"]), []).append(e)
    for es in segments.values():  # a band segment: one entry; a wide one: one per tensor, alike
        assert len(es) == 1 or all(e["kind"] == "wide" for e in es), es
        assert len({(e["nbytes"], e["rows"], e["crc32c"]) for e in es}) == 1, es
    for r in ranks:
        _no_overlap([(off, es[0]["nbytes"]) for (rank, off), es in segments.items() if rank == r], size_of[r],
                    tile=True)
        assert len(parts[r]) == size_of[r]
    for (rank, off), es in segments.items():
        e = es[0]
        for row in read_segment(parts[rank], off, e["nbytes"], e["crc32c"], e["rows"], sid, block_bytes):
            shape = md["tensors"][row["fqn"]]["shape"]
            assert len(row["offsets"]) == len(row["lengths"]) == len(shape) > 0 and min(row["lengths"]) > 0
            lo, hi = row_bands(row, shape, buckets)
            if e["kind"] == "band":  # a banded row, inside its entry's bands
                assert hi - lo + 1 <= limit and e["lo"] <= lo and hi <= e["hi"], (row["fqn"], lo, hi, e)
                add(row, e)
            else:  # a wide row, its name inside one of its segment's entries
                named = [x for x in es if x["first"] <= row["fqn"] <= x["last"]]
                assert hi - lo + 1 > limit and named, (row["fqn"], es)
                add(row, named[0])
    return rows, entries


def _no_overlap(spans: list[tuple[int, int]], total: int, *, tile: bool) -> None:
    end = 0
    for off, n in sorted(spans):
        assert (off == end if tile else off >= end) and off + n <= total, (off, n, end, total)
        end = off + n
    assert not tile or end == total


def v4_lookup(md: dict[str, Any], entries: list[dict[str, Any]], fqn: str, box: dict[str, Any]) -> list[dict[str, Any]]:
    """§5.6's lookup for box ``box`` (offsets, lengths) of ``fqn``: the band
    pages and entries its bands meet, the wide ones whose names contain
    ``fqn``; for a 0-dim tensor, the scalar pages whose names contain it.
    ``entries`` are every entry and scalar page in directory order (``v4_rows``)."""
    d = md["index"]
    if md["tensors"][fqn]["shape"] == []:
        return [e for e in entries if e["kind"] == "scalar" and e["first"] <= fqn <= e["last"]]
    lo_t, hi_t = row_bands(box, md["tensors"][fqn]["shape"], d["buckets"])
    found = []
    for kind, a, b in (("band", "lo", "hi"), ("wide", "first", "last")):
        col = d[f"{kind}_pages"]
        mine = [e for e in entries if e["kind"] == kind]
        start = 0
        for k in range(len(col[a])):
            page, start = mine[start : start + col["rows"][k]], start + col["rows"][k]
            if kind == "band" and col[a][k] <= hi_t and lo_t <= col[b][k]:
                found += [e for e in page if e["lo"] <= hi_t and lo_t <= e["hi"]]
            elif kind == "wide" and col[a][k] <= fqn <= col[b][k]:
                found += [e for e in page if e["first"] <= fqn <= e["last"]]
    return found
