"""The classes Megatron-LM's pickles hold, read as data by bytecp's restricted
unpickler (:mod:`bytecp.interop.torch_zip`), in any process, Megatron
imported or not; no code of theirs runs.

They are the classes Megatron-Core's own ``safe_globals``
(``megatron/core/safe_globals.py``) registers with torch for
``weights_only`` loads: Megatron-LM's ``common.pt`` holds ``args`` (an
``argparse.Namespace`` with ``ModelType``, ``AttnBackend`` and
``signal.Signals`` members, torch dtypes), its ``rng_state`` holds numpy's
RNG state (an ``ndarray`` of ``uint32``) beside torch's generator states.
:data:`ALLOW` maps each global to an inert stand-in that pickle's opcodes
build; :func:`as_data` then turns the stand-ins into plain values:

- an enum member (Megatron-Core's ``ModelType``, ``AttnBackend``,
  ``CudaGraphScope``, ``RerunDiagnostic``, ``RerunMode``, ``RerunState``;
  ``signal.Signals``) -> ``"<Enum>.<member>"`` (megatron-core 0.16.1's names;
  a value it does not know -> ``"<Enum>(<value>)"``);
- ``argparse.Namespace``, ``types.SimpleNamespace``, Megatron-Core's
  ``OptimizerConfig`` (a dataclass) -> a dict of their fields;
- ``pathlib.PosixPath`` -> its text; ``io.BytesIO`` -> its bytes;
- a numpy array (``numpy._core.multiarray._reconstruct`` or numpy 1's
  ``numpy.core...``, ``ndarray``, ``dtype``, ``numpy.dtypes.<X>DType``) of a
  plain numeric dtype -> a numpy array built from its bytes with
  ``np.frombuffer`` (shape, dtype, byte order and size checked), never by
  numpy's own unpickling code; any other dtype is refused.

Who calls it: :mod:`bytecp.interop.torch_dist` (the coordinator of a load,
for ``common.pt`` and every value of a torch_dist checkpoint).
"""

from __future__ import annotations

import functools
import pickle
import posixpath
import signal
from collections.abc import Callable
from typing import Any

import numpy as np

from bytecp.interop.torch_zip import StoredTensor

__all__ = ["ALLOW", "EnumMember", "as_data"]

#: megatron-core 0.16.1's enums: global -> {value: member name}
_ENUMS: dict[str, dict[Any, str]] = {
    "megatron.core.enums.ModelType": {1: "encoder_or_decoder"},
    "megatron.core.transformer.enums.AttnBackend": {1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto"},
    "megatron.core.transformer.enums.CudaGraphScope": {
        1: "full_iteration", 2: "attn", 3: "mlp", 4: "moe", 5: "moe_router", 6: "moe_preprocess", 7: "mamba"},
    "megatron.core.rerun_state_machine.RerunDiagnostic": {
        "correct_result": "CORRECT_RESULT", "transient_error": "TRANSIENT_ERROR",
        "persistent_error": "PERSISTENT_ERROR"},
    "megatron.core.rerun_state_machine.RerunMode": {
        "disabled": "DISABLED", "validate_results": "VALIDATE_RESULTS",
        "report_determinism_stats": "REPORT_DETERMINISM_STATS"},
    "megatron.core.rerun_state_machine.RerunState": {
        0: "NOT_RUNNING_YET", 1: "INITIAL_RUN", 2: "RERUNNING_IN_PLACE", 3: "WILL_RERUN_FROM_CHECKPOINT",
        4: "RERUNNING_FROM_CHECKPOINT", 5: "RERUNNING_AGAIN_FROM_CHECKPOINT"},
    "signal.Signals": {int(s): s.name for s in signal.Signals},
}
#: numpy dtype codes read (numeric and bool, any byte order): code -> the plain dtype
_NUMERIC = {f"{k}{n}": np.dtype(f"{k}{n}") for k, sizes in (("i", (1, 2, 4, 8)), ("u", (1, 2, 4, 8)),
                                                             ("f", (2, 4, 8)), ("c", (8, 16)))
            for n in sizes} | {"b1": np.dtype("?")}
_DTYPE_CLASSES = {f"numpy.dtypes.{type(d).__name__}": code for code, d in _NUMERIC.items()}


class EnumMember:
    """An enum member read as data: its class's name, its member name (None: unknown) and value."""

    def __init__(self, enum: str, name: str | None, value: Any) -> None:
        self.enum, self.name, self.value = enum, name, value

    def __str__(self) -> str:
        return f"{self.enum}.{self.name}" if self.name is not None else f"{self.enum}({self.value!r})"


def _enum(global_name: str, members: dict[Any, str]) -> Callable[..., EnumMember]:
    short = global_name.rpartition(".")[2]

    def member(*args: Any) -> EnumMember:  # pickle's REDUCE: Enum(value)
        if len(args) != 1 or not isinstance(args[0], (int, str)) or isinstance(args[0], bool):
            raise pickle.UnpicklingError(f"{global_name} of {args!r:.60}")
        return EnumMember(short, members.get(args[0]), args[0])

    return member


class _Record:
    """A Namespace, SimpleNamespace or dataclass: its fields (pickle's NEWOBJ or REDUCE, then BUILD)."""

    fields: dict[str, Any] = {}  # (NEWOBJ builds it without __init__; BUILD sets it)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise pickle.UnpicklingError("a namespace built with arguments")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:  # (dict, slots) of a dataclass
            state = state[0]
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(f"a namespace whose state is a {type(state).__name__}")
        self.fields = dict(state)


def _record(name: str) -> type[_Record]:
    return type(name.rpartition(".")[2], (_Record,), {"__module__": __name__})


class _Bytes:
    """An ``io.BytesIO``: its bytes (NEWOBJ, then BUILD with ``(value, position, dict)``)."""

    value = b""  # (NEWOBJ builds it without __init__; BUILD sets it)

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or not state or not isinstance(state[0], bytes):
            raise pickle.UnpicklingError("a BytesIO whose state is not its bytes")
        self.value = state[0]


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path of something other than text")
    return posixpath.join(*parts) if parts else "."


class _Dtype:
    """A numpy dtype: ``numpy.dtype(code, align, copy)`` then BUILD with its byte order."""

    def __init__(self, code: Any = None, align: Any = False, copy: Any = True) -> None:
        if code not in _NUMERIC:
            raise pickle.UnpicklingError(f"numpy dtype {code!r:.40} (bytecp reads numeric dtypes only)")
        self.dtype = _NUMERIC[code]

    def __setstate__(self, state: Any) -> None:
        order = state[1] if isinstance(state, tuple) and len(state) > 1 else None
        if order not in ("<", ">", "|", "="):
            raise pickle.UnpicklingError(f"numpy dtype state {state!r:.60}")
        self.dtype = self.dtype.newbyteorder(order) if order in ("<", ">") else self.dtype


class _NdArray:
    """A numpy array: ``_reconstruct(ndarray, (0,), b"b")``, then BUILD with
    ``(version, shape, dtype, fortran, bytes)``: decoded with ``np.frombuffer``."""

    def __init__(self, subtype: Any = None, shape: Any = None, code: Any = None) -> None:
        if subtype is not _NDARRAY:
            raise pickle.UnpicklingError("_reconstruct of something other than numpy.ndarray")
        self.array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], _Dtype)
                and isinstance(state[1], tuple) and all(type(n) is int and n >= 0 for n in state[1])
                and isinstance(state[4], bytes) and isinstance(state[3], bool)):
            raise pickle.UnpicklingError("a numpy array whose state is not (version, shape, dtype, fortran, bytes)")
        shape, dtype, raw = state[1], state[2].dtype, state[4]
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != len(raw):
            raise pickle.UnpicklingError(f"a numpy array of shape {list(shape)} and {dtype} in {len(raw)} bytes")
        self.array = np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if state[3] else "C").copy()


_NDARRAY = object()  # numpy.ndarray as the argument of _reconstruct


def _dtype_class(code: str, *args: Any) -> _Dtype:
    """``numpy.dtypes.UInt32DType()`` and the like: that plain dtype."""
    if args:
        raise pickle.UnpicklingError(f"numpy's {code} dtype class called with arguments")
    return _Dtype(code)

#: global -> the stand-in the restricted unpickler builds for it
ALLOW: dict[str, Any] = {
    **{name: _enum(name, members) for name, members in _ENUMS.items()},
    "argparse.Namespace": _record("argparse.Namespace"),
    "types.SimpleNamespace": _record("types.SimpleNamespace"),
    "megatron.core.optimizer.optimizer_config.OptimizerConfig": _record("OptimizerConfig"),
    "megatron.core.optimizer.OptimizerConfig": _record("OptimizerConfig"),
    "pathlib.PosixPath": _path,
    "_io.BytesIO": _Bytes,
    "io.BytesIO": _Bytes,
    "numpy.core.multiarray._reconstruct": _NdArray,
    "numpy._core.multiarray._reconstruct": _NdArray,
    "numpy.ndarray": _NDARRAY,
    "numpy.dtype": _Dtype,
    **{name: functools.partial(_dtype_class, code) for name, code in _DTYPE_CLASSES.items()},
}


def as_data(value: Any, tensor: Callable[[Any], Any]) -> Any:
    """``value`` with every stand-in of :data:`ALLOW` as plain data (module
    docstring); ``tensor`` turns each of the unpickler's stored tensors into a tensor."""
    if isinstance(value, EnumMember):
        return str(value)
    if isinstance(value, _Record):
        return {k: as_data(v, tensor) for k, v in value.fields.items()}
    if isinstance(value, _NdArray):
        return value.array
    if isinstance(value, _Dtype):
        return str(value.dtype)
    if isinstance(value, _Bytes):
        return value.value
    if isinstance(value, dict):
        return {k: as_data(v, tensor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_data(v, tensor) for v in value)
    if isinstance(value, StoredTensor):
        return tensor(value)
    return value
