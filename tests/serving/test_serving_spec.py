"""Serving deltas read by a reader written from FORMAT.md §13 alone: plain
JSON, struct, a table CRC-32C, LEB128 gaps and SplitMix64 in pure Python,
nothing of bytecp's. The whole bf16 copy of the first save, brought forward
by the second save's deltas (and its whole copies of the boxes whose delta
would cost more), is the trainer's weights cast to bf16 bit for bit, and
every element checksum the files record is the one the spec defines."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import nn

import bytecp

M64 = (1 << 64) - 1
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def weight(i: int) -> int:
    """w(i): the (i+1)-th output of SplitMix64 seeded with 0."""
    z = ((i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def positions(buf: bytes, count: int) -> list[int]:
    """Strictly increasing positions from their LEB128 gaps."""
    out, value, shift, at = [], 0, 0, 0
    for b in buf:
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            at = value if not out else out[-1] + value
            out.append(at)
            value, shift = 0, 0
    assert len(out) == count and shift == 0
    return out


def test_a_reader_from_the_spec_alone_brings_the_whole_copy_forward_bitwise(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    run = tmp_path / "run"
    mgr = bytecp.CheckpointManager(str(run), every_n_steps=1, keep_last=None, serving_dtype=torch.bfloat16)
    for step in (1, 2):
        model(torch.randn(4, 40, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step, {"model": model})
    want = {f"model.{k}": v.to(torch.bfloat16).view(torch.int16).reshape(-1).tolist() for k, v in
            model.state_dict().items()}

    def files(step: int) -> tuple[dict, dict, Path]:
        ck = run / f"step-{step}"
        sid = json.loads((ck / "metadata.json").read_text())["save_id"]
        d = ck / "serving" / sid
        return json.loads((d / "serving.json").read_text()), json.loads((d / "0.json").read_text()), d

    man1, ents1, d1 = files(1)
    man2, ents2, d2 = files(2)
    assert man1["format"] == "bytecp-serving" and man1["version"] == 1 and man1["dtype"] == "bfloat16"
    assert man1["previous"] is None and man2["previous"]["name"] == "step-1"
    assert man2["previous"]["save_id"] == man1["save_id"] and ents2["previous"] == man2["previous"]
    whole = (d1 / "0.whole.bin").read_bytes()
    assert len(whole) == ents1["whole_nbytes"]
    held: dict[str, list[int]] = {}
    for e in ents1["entries"]:  # one box per tensor here: the box is the whole tensor
        w = e["whole"]
        raw = whole[w["offset"]:w["offset"] + w["nbytes"]]
        assert w["offset"] % 8 == 0 and crc32c(raw) == w["crc32c"]
        bits = list(struct.unpack(f"<{len(raw) // 2}H", raw))
        assert sum(weight(i) * b for i, b in enumerate(bits)) & M64 == int(e["checksum"], 16)
        held[e["fqn"]] = bits
    payload = (d2 / "0.bin").read_bytes() if ents2["delta_nbytes"] else b""
    whole2 = (d2 / "0.whole.bin").read_bytes() if ents2["whole_nbytes"] else b""
    changed = rewritten = 0
    for e in ents2["entries"]:
        bits = held[e["fqn"]]
        if "delta" not in e:  # a box whose delta would cost a reader more: written whole
            w = e["whole"]
            raw = whole2[w["offset"]:w["offset"] + w["nbytes"]]
            assert crc32c(raw) == w["crc32c"]
            bits[:] = struct.unpack(f"<{len(raw) // 2}H", raw)
            assert sum(weight(i) * b for i, b in enumerate(bits)) & M64 == int(e["checksum"], 16)
            rewritten += 1
            continue
        part = e["delta"]
        raw = payload[part["offset"]:part["offset"] + part["nbytes"]]
        n = part["count"]
        assert part["nbytes"] == 2 * n + part["positions_nbytes"] and (n == 0 or crc32c(raw) == part["crc32c"])
        values = struct.unpack(f"<{n}H", raw[:2 * n])
        moved = 0
        for p, v in zip(positions(raw[2 * n:], n), values, strict=True):
            moved += weight(p) * (v - bits[p])
            bits[p] = v
        assert (int(e["before"], 16) + moved) & M64 == int(e["checksum"], 16), e["fqn"]
        changed += n
    assert changed > 0 and rewritten < len(ents2["entries"])
    for fqn, bits in held.items():  # signed int16 views of the trainer's bf16 values, as unsigned bits
        assert [b - 65536 if b >= 32768 else b for b in bits] == want[fqn], fqn
