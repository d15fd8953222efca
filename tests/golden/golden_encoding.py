"""Encoding of golden states for expected.json, and fixed bit patterns
(shared by make_golden.py and its multi-process cases, golden_dist.py)."""

from __future__ import annotations

import fractions
import json
import math
from typing import Any

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The logical bytes of a tensor: little-endian, row-major, no padding."""
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode(v: Any) -> Any:
    """A JSON form of a state tree that keeps every type (read by test_golden.decode)."""
    if isinstance(v, torch.Tensor):
        return {
            "__tensor__": {
                "dtype": dtype_name(v.dtype),
                "shape": list(v.shape),
                "hex": tensor_bytes(v).hex(),
            }
        }
    if type(v) is dict:
        return {"__dict__": [[k, encode(x)] for k, x in v.items()]}
    if type(v) is tuple:
        return {"__tuple__": [encode(x) for x in v]}
    if type(v) is list:
        return [encode(x) for x in v]
    if type(v) is fractions.Fraction:
        return {"__fraction__": [v.numerator, v.denominator]}
    if type(v) is float and not math.isfinite(v):
        return {"__float__": repr(v)}
    if v is None or type(v) in (bool, int, float, str):
        return v
    raise TypeError(f"cannot encode {type(v).__name__} for expected.json")


def canonical(v: Any) -> str:
    """The encoded tree as text with dict entries sorted (key order is not compared)."""

    def sort(x: Any) -> Any:
        if isinstance(x, list):
            return [sort(i) for i in x]
        if isinstance(x, dict):
            if "__dict__" in x:
                pairs = [[k, sort(i)] for k, i in x["__dict__"]]
                return {"__dict__": sorted(pairs, key=lambda kv: json.dumps(kv[0]))}
            return {k: sort(i) for k, i in x.items()}
        return x

    return json.dumps(sort(v), sort_keys=True)


def pattern(shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """A fixed bit pattern of any dtype (NaN and other special encodings included)."""
    size = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    raw = (
        torch.arange(n * size, dtype=torch.int64)
        .mul(73)
        .add(41 + salt)
        .remainder(256)
        .to(torch.uint8)
    )
    if dtype == torch.bool:
        return (raw[:n] % 3 == 0).reshape(shape)
    return raw.view(dtype).reshape(shape)


# ----------------------------------------------------------------- reading expected.json
def make_tensor(d: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    raw = bytes.fromhex(d["hex"])
    if not raw:
        return torch.empty(d["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(d["shape"])


def decode(v: Any) -> Any:
    """The inverse of make_golden.encode."""
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict):
        ((tag, body),) = v.items()
        if tag == "__tensor__":
            return make_tensor(body)
        if tag == "__dict__":
            return {k: decode(x) for k, x in body}
        if tag == "__tuple__":
            return tuple(decode(x) for x in body)
        if tag == "__float__":
            return float(body)
        if tag == "__fraction__":
            return fractions.Fraction(*body)
        raise AssertionError(f"unknown tag {tag!r} in expected.json")
    return v


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return b"" if t.numel() == 0 else t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Exact equality: types, dict keys, tensor dtype, shape and bits."""
    assert type(got) is type(want) or (
        isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    ), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), (
            f"{where}: {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}"
        )
        assert raw_bytes(got) == raw_bytes(want), f"{where}: bits differ"
    elif isinstance(want, dict):
        assert list(got) == list(want) or set(got) == set(want), (
            f"{where}: keys {list(got)} != {list(want)}"
        )
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}.{i}")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"
