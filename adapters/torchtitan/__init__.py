"""bytecp as torchtitan's checkpointer: ``BytecpCheckpointManager``.

A ``BaseCheckpointManager`` of torchtitan 0.3.0 (the interface moves in
torchtitan's main branch; this module is pinned to 0.3.0). Select it with
one line of a config function::

    checkpoint=BytecpCheckpointManager.Config(enable=True, interval=500, async_mode="lazy")

or on the command line with ``--override.imports bytecp.adapters.torchtitan.use_bytecp``
(see :func:`use_bytecp`); ``--checkpoint.*`` flags keep setting single fields.

It keeps the DCP manager's semantics field for field (``interval``,
``keep_latest_k``, ``load_step``, ``initial_load_*``, ``last_save_*``,
``exclude_from_loading``, ``load_only``, ``create_seed_checkpoint``,
``enable_first_step_checkpoint``) and saves the same five states (model
parts, optimizers, LR schedulers, dataloader, train state) as a bytecp
checkpoint per step, ``<dump_folder>/<folder>/step-<N>``: each rank writes
its own shards, and the checkpoint loads under any other parallelism or in
one process (``bytecp.load_state_dict``). Call order (torchtitan's trainer,
every rank): ``__init__`` -> ``load`` -> per step ``maybe_wait_for_staging``
(before ``optimizers.step``) and ``save`` -> ``close``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from bytecp.plugins import missing_extra

try:
    from torchtitan.components.checkpointer.base import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.config.override import override
    from torchtitan.tools import filesystem
except ModuleNotFoundError as e:  # torchtitan itself goes in with --no-deps: it lists torch
    raise missing_extra(e, "torchtitan", __name__, install="pip install --no-deps torchtitan==0.3.0 "
                        "&& pip install 'bytecp[torchtitan]' (docs/torchtitan.md)") from None

import bytecp
from bytecp.adapter_api import register_adapter
from bytecp.catalog import list_checkpoints
from bytecp.errors import StateMismatchError
from bytecp.format import metadata as fmt
from bytecp.interop.runs import is_bytecp_folder
from bytecp.storage_api import open_storage
from bytecp.tools.resume import Decision, decide_together, first_that_loads

from .hf import export_last_step_hf, load_initial_hf

__all__ = ["BytecpCheckpointManager", "use_bytecp", "ASYNC_MODES"]

log = logging.getLogger("bytecp.torchtitan")

register_adapter("torchtitan", "bytecp.adapters.torchtitan.state:TorchtitanStateAdapter")

_STEP = re.compile(r"^step-\d+$")

#: ``async_mode`` values: DCP's names, plus ``lazy``
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem", "lazy")


class BytecpCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, saving and loading with bytecp.

    Built by torchtitan's trainer from :class:`Config` (``config.checkpoint.build(...)``),
    with the trainer's components; every public method runs on every rank.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint policy fields, plus bytecp's own."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem", "lazy"] = "disabled"
        """``disabled``: ``save`` returns once committed; ``async`` (or DCP's
        ``async_with_pinned_mem``, same here): returns once this rank's tensors are
        copied to reused host memory, the write and commit run in the background;
        ``lazy``: returns at once, the copy overlaps the next forward/backward and
        ``optimizers.step()`` waits only while it is unfinished."""

        io_threads: int = 4
        """Data files each rank writes at once."""

        verify: bool = True
        """Check every chunk's crc32c while loading."""

        storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
        """bytecp storage options for an object-store ``folder`` (``endpoint_url``, ``retry``, ...)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            if mode not in ASYNC_MODES:
                raise ValueError(f"checkpoint.async_mode={self.async_mode!r}: choose one of {', '.join(ASYNC_MODES)}")
            self.async_mode = mode  # type: ignore[assignment]
            if self.io_threads < 1:
                raise ValueError(f"checkpoint.io_threads={self.io_threads}: needs at least 1")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: bytecp.SaveHandle | None = None
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        if dataloader is None:
            del self.states[DATALOADER]
        self.sd_adapter = sd_adapter
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf needs the model's state-dict adapter (its ModelSpec has none)")
        self._purger = ThreadPoolExecutor(1, thread_name_prefix="bytecp-purge") if config.keep_latest_k > 0 else None
        log.info("bytecp checkpointing: loading from and saving to %s", self.folder)

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------ helpers
    def _url(self, step: int, folder: str = "") -> str:
        return filesystem.join(folder or self.folder, f"step-{step}")

    def _decision(self) -> Decision:
        """(every rank) What the folder has to resume: the one decision
        (:mod:`bytecp.tools.resume`: bytecp's committed checkpoints and, newer
        than them, those torchtitan's DCP backend wrote before the job moved
        onto bytecp), taken on rank 0 and broadcast; a storage error raised."""
        return decide_together(self.folder, self.config.storage_options)

    def _flat_states(self) -> dict[str, Any]:
        return dict(self.states)

    def _save_kwargs(self, step: int) -> dict[str, Any]:
        return {"framework": "torchtitan", "step": step, "overwrite": True, "io_threads": self.config.io_threads,
                "storage_options": self.config.storage_options}

    # ------------------------------------------------------------ save
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """(every rank) Save at the interval, on the first step if asked, and
        at the last step (model only unless ``last_save_model_only=False``)."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # one save in flight; its error surfaces here
        begin = time.monotonic()
        url = self._url(curr_step)
        if last_step:
            self._save_last_step(curr_step, url)
        elif self.config.async_mode == "disabled":
            bytecp.save(url, self._flat_states(), **self._save_kwargs(curr_step))
        else:
            handle = bytecp.async_save(url, self._flat_states(), lazy=self.config.async_mode == "lazy",
                                       **self._save_kwargs(curr_step))
            self.save_future = handle
            handle.add_done_callback(lambda h: self._purge() if h.exception() is None else None)
            log.info("bytecp: step %d checkpoint handed over in %.2f s", curr_step, time.monotonic() - begin)
            return True
        self._purge()
        log.info("bytecp: saved step %d to %s in %.2f s", curr_step, url, time.monotonic() - begin)
        return True

    def _save_last_step(self, step: int, url: str) -> None:
        if not self.config.last_save_model_only:
            bytecp.save(url, self._flat_states(), **self._save_kwargs(step))
            return
        sd = {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in self.states[MODEL].state_dict().items()}
        if self.config.last_save_in_hf:
            export_last_step_hf(self.sd_adapter, sd, url, self._save_kwargs(step))
        else:
            bytecp.save(url, {MODEL: sd}, **self._save_kwargs(step))

    def _purge(self) -> None:
        """(coordinator, in a background thread) Keep the newest ``keep_latest_k``
        committed checkpoints; an unfinished save is never listed, so never deleted."""
        if self._purger is None or (dist.is_initialized() and dist.get_rank() != 0):
            return
        self._purger.submit(self._purge_now)

    def _purge_now(self) -> None:
        try:
            opts = self.config.storage_options
            found = [c for c in list_checkpoints(self.folder, storage_options=opts)
                     if c.step is not None and _STEP.match(c.name)]
            root = open_storage(self.folder, **opts)
            for old in found[: max(0, len(found) - self.config.keep_latest_k)]:
                root.delete([f"{old.name}/{fmt.METADATA_FILE}"])  # it stops existing first
                root.delete_prefix(old.name)
                log.info("bytecp: deleted %s (keep_latest_k=%d)", old.url, self.config.keep_latest_k)
        except Exception as e:  # a failed deletion must not stop training or later purges
            log.warning("bytecp: purging %s failed: %s", self.folder, e)

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an ``async`` save returns once staged, and a
        ``lazy`` one holds ``optimizers.step()`` in a pre-step hook until staged."""

    def _wait_for_saving(self) -> None:
        handle, self.save_future = self.save_future, None
        assert handle is not None
        handle.wait()

    def _close(self) -> None:
        try:
            self.maybe_wait_for_saving()
        except Exception as e:
            log.error("bytecp: the last asynchronous checkpoint failed: %s", e)
        if self._purger is not None:
            self._purger.shutdown(wait=True)

    # ------------------------------------------------------------ load
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """(every rank) Resume from ``step`` (-1: the newest committed checkpoint
        that loads, falling back past one whose own files are bad) in
        ``folder``; with nothing to resume there, from ``initial_load_path``;
        else a fresh start. A folder whose newest checkpoint cannot be told
        raises (:class:`~bytecp.errors.ResumeDecisionError`), as does a storage
        error: never a fresh start over the run's own checkpoints."""
        cfg = self.config
        decision = self._decision()
        if step != -1:  # an explicit step: that one, or its error (no fallback)
            committed = {c.step: c.url for c in decision.checkpoints if c.step is not None}
            if step not in committed:
                have = ", ".join(map(str, sorted(committed))) or "none"
                raise FileNotFoundError(f"--checkpoint.load_step={step}: no committed checkpoint "
                                        f"{self._url(step)} (committed steps in {self.folder}: {have})")
            self._load_url(committed[step], step == 0, False)
            return True
        candidates = decision.candidates()  # raises when undecided: the initial_* options never hide a run
        if candidates:  # resuming: the initial_* options are ignored, as DCP's manager does
            first_that_loads(candidates, lambda c: self._load_url(c.url, c.step == 0, False), run_url=self.folder)
            return True
        if cfg.initial_load_in_hf:
            path = cfg.initial_load_path or getattr(self.sd_adapter, "hf_assets_path", None)
            if not path or not filesystem.isdir(path):
                raise ValueError(f"checkpoint.initial_load_in_hf: {path!r} is not a directory of Hugging Face "
                                 "safetensors; set checkpoint.initial_load_path (or hf_assets_path)")
            load_initial_hf(self.sd_adapter, self.states[MODEL], path, cfg.initial_load_in_hf_quantized)
            return True
        if cfg.initial_load_path:
            self._load_url(cfg.initial_load_path, cfg.initial_load_model_only, True)
            return True
        log.info("bytecp: %s; no initial_load_path: a fresh start", decision.describe())
        return False

    def _load_url(self, url: str, model_only: bool, initial: bool) -> None:
        begin = time.monotonic()
        if model_only:
            states = {MODEL: self.states[MODEL]}
        else:
            for key in self.config.exclude_from_loading:
                if key not in self.states:
                    raise ValueError(f"checkpoint.exclude_from_loading names {key!r}, which is not a checkpointed "
                                     f"state; the states are {', '.join(sorted(self.states))}")
            states = {k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading}
        foreign = not is_bytecp_folder(open_storage(url, **self.config.storage_options))
        names: set[str] = set()
        if foreign:  # a DCP checkpoint: named as torchtitan's DCP backend flattens the states
            states, names = _flattened(states)
        result = bytecp.load(url, states, framework="torchtitan", strict=False, verify=self.config.verify,
                             storage_options=self.config.storage_options)
        if foreign:  # as torchtitan's DCP load: the model's own hooks (fused wqkv) see the tensors
            if names:  # (never ask the wrapper's state_dict again first: it refreshes its cache)
                self.states[MODEL].load_state_dict({k: states[k] for k in names})
            missing = sorted({MODEL if k in names else k.split(".", 1)[0] for k in result.missing_keys})
        else:
            missing = sorted({k.split(".", 1)[0] for k in result.missing_keys})
        if missing:
            if MODEL in missing:
                hint = "its model tensors are named otherwise: is it a checkpoint of this model?"
            elif initial:
                hint = "set checkpoint.initial_load_model_only=True, or list them in checkpoint.exclude_from_loading"
            else:
                hint = "list them in checkpoint.exclude_from_loading"
            raise StateMismatchError(f"{url} holds no {', '.join(missing)} state "
                                     f"(e.g. {result.missing_keys[0]}); {hint}")
        log.info("bytecp: loaded %s%s in %.2f s", url, " (model only)" if model_only else "",
                 time.monotonic() - begin)


def _flattened(states: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """``states`` as torchtitan's DCP backend saves them: the model's tensors
    at the top level under their own names, the other states under theirs;
    and the model's names."""
    flat = {k: v for k, v in states.items() if k != MODEL}
    model = states[MODEL].state_dict() if MODEL in states else {}
    flat.update(model)
    return flat, set(model)


@override(target=BaseCheckpointManager.Config)
def use_bytecp(config: BaseCheckpointManager.Config, **options: Any) -> BytecpCheckpointManager.Config:
    """``--override.imports bytecp.adapters.torchtitan.use_bytecp``: the config
    function's checkpoint settings (``--checkpoint.*`` flags included), saved and
    loaded by bytecp. Inherited fields carry over, ``async_mode`` too where the
    config has one; ``options`` set bytecp's own fields
    (``'bytecp.adapters.torchtitan.use_bytecp={"async_mode": "lazy"}'``)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(BytecpCheckpointManager.Config)
              if f.init and hasattr(config, f.name)}
    return BytecpCheckpointManager.Config(**{**values, **options})
