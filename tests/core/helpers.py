"""Helpers for exact (bitwise) tensor comparison in tests."""

from __future__ import annotations

import torch

from bytecp.tree.dtypes import byte_view


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), dtype and shape too."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(byte_view(a.contiguous()), byte_view(b.contiguous()))


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw[..., 0] & 1).bool()
    if not shape:
        return raw.view(dtype).reshape(())
    return raw.view(dtype).reshape(shape)


def tensor_specs(meta: dict) -> dict:
    """A parsed metadata.json's tensors as ``{fqn: {"dtype", "shape"}}``,
    whichever form it has (version 4 writes a table of columns; readers
    accept the older object form too, which tests edit by hand)."""
    t = meta["tensors"]
    if set(t) != {"names", "dtypes", "dtype", "ndim", "dims"}:
        return t
    out, pos = {}, 0
    for name, d, n in zip(t["names"], t["dtype"], t["ndim"], strict=True):
        out[name] = {"dtype": t["dtypes"][d], "shape": t["dims"][pos : pos + n]}
        pos += n
    return out


def as_object_form(meta: dict) -> dict:
    """``meta`` with its tensors in the object form, which a test can edit in place."""
    meta["tensors"] = tensor_specs(meta)
    return meta["tensors"]
