"""PyTorch Lightning plugin: bytecp as the ``Trainer``'s checkpointing layer.

Use a bytecp strategy in place of Lightning's and keep everything else
(``ModelCheckpoint``, ``trainer.fit(ckpt_path=...)``, ``save_top_k``)::

    from bytecp.adapters.lightning import BytecpModelParallelStrategy

    trainer = Trainer(strategy=BytecpModelParallelStrategy(data_parallel_size=8),
                      callbacks=[ModelCheckpoint(dirpath="s3://bucket/run7", every_n_train_steps=1000)])
    trainer.fit(model, ckpt_path=latest_checkpoint("s3://bucket/run7"))   # any world size

Why a strategy and not only a ``CheckpointIO``: Lightning calls
``CheckpointIO.save_checkpoint`` on rank 0 alone (DDP) or bypasses it for
sharded state (FSDP and ``ModelParallelStrategy`` write with
``torch.distributed.checkpoint`` themselves), and it builds the checkpoint
dict from gathered or converted state dicts first. The strategy mixin below
skips that conversion and hands :class:`BytecpCheckpointIO` the *live*
module and optimizers on every rank, so bytecp sees each rank's DTensor
shards (FSDP2/TP) or the replicated DDP tensors directly, saves
asynchronously, and loads in place under any world size or parallelism.

Call order (all ranks unless noted):

save: ``ModelCheckpoint`` -> ``trainer.save_checkpoint`` -> Lightning's
``dump_checkpoint`` (trainer state; :meth:`BytecpStrategyMixin.lightning_module_state_dict`
and ``optimizer_state`` return ``{}``: nothing is gathered) ->
:meth:`BytecpStrategyMixin.save_checkpoint` puts the live module and
optimizers into the dict -> :meth:`BytecpCheckpointIO.save_checkpoint` maps
it onto a bytecp state (``model``, ``optimizer``, ``lightning``: rank 0's
trainer state as one object) and starts ``bytecp.async_save`` (the previous
save is waited for first). ``remove_checkpoint`` (rank 0, ``save_top_k``)
deletes only once the save in flight has committed. ``teardown`` waits for
the save in flight and raises its error.

load: ``trainer.fit(ckpt_path=URL)`` (``latest_checkpoint(dirpath)`` or
``"last"`` with :class:`BytecpModelCheckpoint`: the resume decision,
:mod:`.resume`) -> after the strategy set up the model and optimizers ->
:meth:`BytecpStrategyMixin.load_checkpoint` -> :meth:`BytecpCheckpointIO.load_into`
fills the live tensors in place and returns the trainer state, from which
Lightning restores loops, callbacks, schedulers and the precision plugin.

Works with ``lightning.pytorch`` and ``pytorch_lightning``: :mod:`.compat` picks the one
the program uses (``BYTECP_LIGHTNING`` chooses; ``PACKAGE`` says which). The core imports neither.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from bytecp.adapters.lightning.compat import (
    PACKAGE,
    CheckpointIO,
    DDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    TrainerFn,
)
from bytecp.adapters.lightning.loaders import LOADERS_KEY, defer_load, loader_state, train_loaders
from bytecp.adapters.lightning.native import is_native, load_native
from bytecp.adapters.lightning.resume import BytecpModelCheckpoint, fallbacks_of, latest_checkpoint
from torch import nn

import bytecp
from bytecp.catalog import CheckpointInfo
from bytecp.errors import BytecpError, ConfigError, StateMismatchError
from bytecp.format import metadata as fmt
from bytecp.saving.handles import SaveHandle
from bytecp.storage_api import open_storage
from bytecp.tools.resume import first_that_loads
from bytecp.tree.state import Whole

__all__ = [
    "PACKAGE",
    "BytecpCheckpointIO",
    "BytecpStrategyMixin",
    "BytecpDDPStrategy",
    "BytecpModelParallelStrategy",
    "BytecpSingleDeviceStrategy",
    "BytecpModelCheckpoint",
    "latest_checkpoint",
]

log = logging.getLogger("bytecp.lightning")

#: the bytecp state key of Lightning's trainer state (loops, callbacks, ...)
TRAINER_KEY = "lightning"
MODEL_KEY = "model"
#: options the plugin sets itself on every save/load
_OWN_SAVE = {"step", "overwrite", "lazy", "storage_options", "allow_pickle"}
_OWN_LOAD = {"strict", "storage_options", "allow_pickle"}


def optimizer_keys(n: int) -> list[str]:
    """State keys of ``n`` optimizers: ``optimizer`` for one, else ``optimizer_<i>``."""
    return ["optimizer"] if n == 1 else [f"optimizer_{i}" for i in range(n)]


def _url(path: Any) -> str:
    return os.fspath(path) if isinstance(path, os.PathLike) else str(path)


class BytecpCheckpointIO(CheckpointIO):
    """Writes and reads Lightning checkpoints with bytecp (all ranks).

    Used through a bytecp strategy (:class:`BytecpStrategyMixin`), which
    hands it the live model and optimizers; pass an instance as the
    strategy's ``checkpoint_io=`` or in ``Trainer(plugins=[...])`` to set
    the options:

    - ``async_save=True``: ``bytecp.async_save``; the call returns once this
      rank's tensors are copied (``lazy=True``: at once, the copy overlaps
      the next forward/backward and ``optimizer.step`` waits for it). The
      next save, ``wait()`` and the strategy's teardown wait for it and
      raise its error (from any rank).
    - ``overwrite=True``: a save onto an existing checkpoint (``last.ckpt``)
      replaces it once the new one commits, as Lightning expects.
    - ``storage_options``: bytecp storage options (``endpoint_url``, ...).
    - ``allow_pickle``: store and load trainer-state values that only a full
      unpickler can read (``hparams`` holding arbitrary objects).
    - ``save_options`` / ``load_options``: other keyword arguments of
      ``bytecp.async_save``/``save`` (``io_threads``, ``memory_budget_bytes``,
      ``monitor``, ``verify_replicas``) and ``bytecp.load`` (``verify``,
      ``io_threads``, ``zero_redundancy``).
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        lazy: bool = False,
        overwrite: bool = True,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        save_options: dict[str, Any] | None = None,
        load_options: dict[str, Any] | None = None,
    ) -> None:
        if lazy and not async_save:
            raise ConfigError("BytecpCheckpointIO: lazy=True needs async_save=True (a lazy save is asynchronous)")
        for name, given, own in (("save_options", save_options, _OWN_SAVE), ("load_options", load_options, _OWN_LOAD)):
            clash = sorted(own & set(given or {}))
            if clash:
                raise ConfigError(f"BytecpCheckpointIO: {name} may not set {clash}: they are arguments of their own")
        self.async_save = async_save
        self.lazy = lazy
        self.overwrite = overwrite
        self.storage_options = dict(storage_options or {})
        #: (set by load_into) the checkpoint whose per-rank train loaders load once the fit loop built them
        self.loaders_from: str | None = None
        self.allow_pickle = allow_pickle
        self.save_options = dict(save_options or {})
        self.load_options = dict(load_options or {})
        #: the save in flight (or the last one)
        self._handle: SaveHandle | None = None
        #: checkpoints Lightning asked to remove while a save was in flight,
        #: with that save: removed once it commits, kept if it fails
        self._deferred: list[tuple[SaveHandle, str]] = []
        self._lock = threading.Lock()
        #: set once the last save's deferred removals are settled
        self._settled = threading.Event()
        self._settled.set()
        #: a failed save whose error bytecp already raised (at the next save)
        self._reported: SaveHandle | None = None

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None,
                        loaders: list[Any] | None = None) -> None:
        """(all ranks, called by the strategy) Save Lightning's checkpoint dict
        whose ``state_dict`` is the live module and ``optimizer_states`` the
        live optimizers; everything else is rank 0's trainer state, less the
        fit loop's stateful train ``loaders``, saved per rank with their data
        positions (:mod:`bytecp.adapters.lightning.loaders`)."""
        url = _url(path)
        model = checkpoint.get("state_dict")
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"BytecpCheckpointIO saves the live (sharded) model and optimizers on every rank, but the "
                f"checkpoint for {url} holds a plain state dict: use a bytecp strategy (BytecpDDPStrategy, "
                "BytecpModelParallelStrategy, BytecpSingleDeviceStrategy, or BytecpStrategyMixin with yours)"
            )
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        state: dict[str, Any] = {MODEL_KEY: model}
        if "optimizer_states" in checkpoint:  # absent: save_weights_only
            optims = list(checkpoint["optimizer_states"])
            state.update(zip(optimizer_keys(len(optims)), optims, strict=True))
        rest, per_rank = loader_state(rest, loaders or [])
        if per_rank:
            state[LOADERS_KEY] = per_rank
        # rank 0's trainer state as one object (JSON, or a weights_only blob when it holds tensors)
        state[TRAINER_KEY] = Whole(rest)
        so = {**self.storage_options, **(storage_options or {})}
        kwargs: dict[str, Any] = dict(step=rest.get("global_step"), overwrite=self.overwrite,
                                      storage_options=so, allow_pickle=self.allow_pickle, **self.save_options)
        if not self.async_save:
            bytecp.save(url, state, **kwargs)
            return
        previous = self._handle
        try:
            handle = bytecp.async_save(url, state, lazy=self.lazy, **kwargs)
        except BytecpError:
            if previous is not None and previous.exception() is not None:
                self._reported = previous  # raised here, on every rank: not again at teardown
            raise
        with self._lock:
            self._handle = handle
            self._settled.clear()
        handle.add_done_callback(self._after_save)

    def wait(self, timeout: float | None = None) -> None:
        """(all ranks) Block until the save in flight has committed and the
        removals waiting for it are done; raise its error (from any rank)
        once: a later ``wait`` (Lightning tears down twice after an error)
        or the next save does not raise it again."""
        handle = self._handle
        if handle is None:
            return
        try:
            handle.wait(timeout)
        except Exception:
            if handle is self._reported:
                pass  # raised once already (here, or by the next save)
            else:
                self._reported = handle
                raise
        if not self._settled.wait(timeout):
            raise TimeoutError(f"removals after the save to {handle.url} not finished after {timeout} s")

    @property
    def handle(self) -> SaveHandle | None:
        """The save in flight, or the last one (None before the first async save)."""
        return self._handle

    # ---------------------------------------------------------------- remove
    def remove_checkpoint(self, path: Any) -> None:
        """(rank 0: ``save_top_k`` retention) Delete a checkpoint, ``metadata.json``
        first. While a save is in flight the deletion waits for its commit (a
        failed save deletes nothing), so a committed checkpoint always exists."""
        url = _url(path)
        with self._lock:
            handle = self._handle
            if handle is not None and not handle.done():
                if url.rstrip("/") != handle.url.rstrip("/"):
                    self._deferred.append((handle, url))
                return
            failed = handle is not None and handle.exception() is not None
        if failed:
            log.warning("bytecp: not removing %s: the last save (%s) failed", url, handle.url if handle else "")
            return
        self._delete(url)

    def _after_save(self, handle: SaveHandle) -> None:
        """(the save's background thread) Apply the removals that waited for
        this save once it has committed; keep them if it failed."""
        try:
            with self._lock:
                mine = [url for h, url in self._deferred if h is handle]
                self._deferred = [(h, url) for h, url in self._deferred if h is not handle]
            if handle.exception() is None:
                for url in mine:
                    self._delete(url)
            elif mine:
                log.warning("bytecp: kept %s: the save to %s failed", mine, handle.url)
        finally:
            if handle is self._handle:
                self._settled.set()

    def _delete(self, url: str) -> None:
        parent, _, name = url.rstrip("/").rpartition("/")
        root = open_storage(parent or ".", **self.storage_options)
        root.delete([f"{name}/{fmt.METADATA_FILE}"])  # the checkpoint stops existing first
        root.delete_prefix(name)

    # ------------------------------------------------------------------ load
    def load_into(
        self, path: Any, model: nn.Module, optimizers: list[Any], *, strict: bool = True,
        fallbacks: tuple[CheckpointInfo, ...] = (),
    ) -> dict[str, Any]:
        """(all ranks, called by the strategy) Fill ``model`` and ``optimizers``
        in place from the checkpoint at ``path`` (any world size and
        parallelism) and return Lightning's trainer state (loops, callbacks,
        ``lr_schedulers``, ...). ``strict`` applies to the model's keys; an
        optimizer must match exactly, and a checkpoint saved with
        ``save_weights_only`` cannot restore optimizers. ``fallbacks``: when
        ``path`` is a run's newest (``latest_checkpoint``, ``ckpt_path="last"``),
        its older checkpoints, tried when its own files are bad."""
        self.wait()  # a save in flight may be the checkpoint asked for
        out: list[dict[str, Any]] = []
        first_that_loads([CheckpointInfo(_url(path), _url(path), None, ""), *fallbacks], fallback=bool(fallbacks),
                         load=lambda c: out.append(self._load_one(c.url, model, optimizers, strict)),
                         run_url=_url(path).rstrip("/").rpartition("/")[0])
        return out[-1]

    def _load_one(self, url: str, model: nn.Module, optimizers: list[Any], strict: bool) -> dict[str, Any]:
        self.loaders_from = None  # (the checkpoint that loads sets it)
        storage = open_storage(url, **self.storage_options)
        if is_native(storage):  # Lightning's own ModelParallelStrategy checkpoint (a job moving onto bytecp)
            return load_native(url, storage, model, optimizers, strict=strict, allow_pickle=self.allow_pickle,
                               options={"storage_options": self.storage_options, **self.load_options})
        keys = optimizer_keys(len(optimizers)) if optimizers else []
        state: dict[str, Any] = {MODEL_KEY: model, **dict(zip(keys, optimizers, strict=True)), TRAINER_KEY: None}
        result = bytecp.load(url, state, strict=False, storage_options=self.storage_options,
                             allow_pickle=self.allow_pickle, **self.load_options)
        saved = {str(k) for k, _ in result.metadata.skeleton.items}
        if TRAINER_KEY not in saved:
            raise ConfigError(
                f"{url} was not saved by bytecp's Lightning plugin (it has no {TRAINER_KEY!r} trainer state); "
                "load it with bytecp.load or bytecp.load_state_dict"
            )
        if keys and not any(k.startswith("optimizer") for k in saved):
            raise ConfigError(
                f"{url} holds only the model (saved with save_weights_only=True): it cannot restore the "
                "optimizers to resume training; load the weights with trainer.validate/test(ckpt_path=...)"
            )

        def checked(fqn: str) -> bool:
            top = fqn.split(".", 1)[0]
            return (top == MODEL_KEY and strict) or (bool(keys) and top.startswith("optimizer"))

        bad_missing = [k for k in result.missing_keys if checked(k)]
        bad_unexpected = [k for k in result.unexpected_keys if checked(k)]
        if bad_missing or bad_unexpected:
            parts = [f"{url} does not match the model and optimizers being restored:"]
            if bad_missing:
                parts.append(f"  missing from the checkpoint ({len(bad_missing)}): {bad_missing[:8]}")
            if bad_unexpected:
                parts.append(f"  in the checkpoint but not in the state ({len(bad_unexpected)}): {bad_unexpected[:8]}")
            parts.append("  (the model's keys are checked when LightningModule.strict_loading is True)")
            raise StateMismatchError("\n".join(parts))
        self.loaders_from = url if LOADERS_KEY in saved else None
        trainer_state = state[TRAINER_KEY]
        if not isinstance(trainer_state, dict):
            raise ConfigError(f"{url}: the {TRAINER_KEY!r} trainer state is a {type(trainer_state).__name__}, not a dict")
        return trainer_state

    def load_loaders(self, url: str, state: dict[str, Any]) -> None:
        """(all ranks, once the fit loop built its loaders) Each rank's saved
        train loaders into ``state``'s live ones, resharded at another layout."""
        bytecp.load(url, state, strict=False, storage_options=self.storage_options, allow_pickle=self.allow_pickle,
                    **self.load_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """(one process, no live objects: evaluation and tools) The model's full
        tensors under ``state_dict`` and Lightning's trainer state; optimizer
        state is not in ``torch.optim`` form here, so it is left out (resume
        training through a bytecp strategy, or read it with
        ``bytecp.load_state_dict``)."""
        sd = bytecp.load_state_dict(_url(path), storage_options=self.storage_options,
                                    allow_pickle=self.allow_pickle)
        trainer_state = sd.get(TRAINER_KEY)
        if not isinstance(trainer_state, dict) or MODEL_KEY not in sd:
            raise ConfigError(
                f"{_url(path)} was not saved by bytecp's Lightning plugin (no {MODEL_KEY!r} and "
                f"{TRAINER_KEY!r} entries); load it with bytecp.load_state_dict"
            )
        return {**trainer_state, "state_dict": sd[MODEL_KEY]}

    def teardown(self) -> None:
        """(all ranks) Lightning's end of the run: wait for the save in flight."""
        self.wait()


class BytecpStrategyMixin:
    """Makes a Lightning strategy checkpoint through :class:`BytecpCheckpointIO`.

    Mix it in front of a Lightning strategy class (``class
    MyStrategy(BytecpStrategyMixin, DDPStrategy)``); the classes below are
    the ones tested. It accepts ``checkpoint_io=`` whatever the base
    strategy's signature. Lightning's ``on_save_checkpoint`` hooks see an
    empty ``state_dict`` and ``optimizer_states``: the live objects are saved
    instead, so nothing is gathered or converted.
    """

    _checkpoint_io: Any

    def __init__(self, *args: Any, checkpoint_io: BytecpCheckpointIO | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if checkpoint_io is not None:
            self.checkpoint_io = checkpoint_io

    @property
    def checkpoint_io(self) -> CheckpointIO:
        return self.bytecp_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        if not isinstance(io, BytecpCheckpointIO):
            raise ConfigError(
                f"{type(self).__name__} checkpoints through BytecpCheckpointIO, not {type(io).__name__}: "
                "pass BytecpCheckpointIO(...) (as checkpoint_io= or in Trainer(plugins=[...])) or nothing"
            )
        self._checkpoint_io = io

    @property
    def bytecp_io(self) -> BytecpCheckpointIO:
        """The strategy's :class:`BytecpCheckpointIO` (a default one unless set)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = BytecpCheckpointIO()
        if not isinstance(self._checkpoint_io, BytecpCheckpointIO):
            raise ConfigError(
                f"{type(self).__name__} checkpoints through BytecpCheckpointIO, not "
                f"{type(self._checkpoint_io).__name__}: pass BytecpCheckpointIO(...) or no checkpoint_io"
            )
        return self._checkpoint_io

    # ---- Lightning hooks: nothing is gathered, the live objects are saved
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load into the set-up (wrapped, sharded) model and the created optimizers."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # filled in place by load_checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # filled in place by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # filled in place by load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """(all ranks) Rank 0's path; the live model and optimizers."""
        url = self.broadcast(_url(filepath))  # type: ignore[attr-defined]
        checkpoint["state_dict"] = self.model  # type: ignore[attr-defined]
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = list(self.optimizers)  # type: ignore[attr-defined]
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        self.bytecp_io.save_checkpoint(checkpoint, url, storage_options=storage_options,
                                       loaders=train_loaders(trainer))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """(all ranks) Fill the live model (and, when fitting, the optimizers) in place."""
        url, fallbacks = self.broadcast((_url(checkpoint_path), fallbacks_of(_url(checkpoint_path))))  # type: ignore[attr-defined]
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = getattr(module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        optimizers = list(self.optimizers) if fitting else []  # type: ignore[attr-defined]
        io = self.bytecp_io
        out = io.load_into(url, self.model, optimizers,  # type: ignore[attr-defined]
                           strict=bool(getattr(module, "strict_loading", True)), fallbacks=fallbacks)
        if fitting and io.loaders_from is not None:  # the train loaders exist only once the fit loop built them
            loaders_url = io.loaders_from
            defer_load(trainer, lambda state: io.load_loaders(loaders_url, state))
        return out

    def teardown(self) -> None:
        """(all ranks) Wait for the save in flight (raising its error), then tear down."""
        try:
            self.bytecp_io.wait()
        finally:
            super().teardown()  # type: ignore[misc]


class BytecpDDPStrategy(BytecpStrategyMixin, DDPStrategy):
    """``DDPStrategy`` checkpointing through bytecp: every rank writes about
    1/W of the (replicated) bytes."""


class BytecpModelParallelStrategy(BytecpStrategyMixin, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallel)
    checkpointing through bytecp: each rank saves its DTensor shards."""


class BytecpSingleDeviceStrategy(BytecpStrategyMixin, SingleDeviceStrategy):
    """One process (``devices=1``): resume or evaluate a checkpoint saved by any number of ranks."""
