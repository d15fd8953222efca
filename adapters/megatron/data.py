"""Megatron-LM's training-data position across a data-parallel size change.

Megatron-LM keeps no data loader state: a resumed job builds its loaders
*after* loading, from ``args.consumed_train_samples`` (and
``consumed_valid_samples``), the samples every data-parallel rank together
consumed. Its samplers (``megatron/training/datasets/data_samplers.py``)
read that global count as follows, with ``m`` the micro-batch size, ``D`` the
data-parallel size and ``N`` the dataset's length:

- ``dataloader_type='single'`` (the default; ``MegatronPretrainingSampler``):
  indices ``C, C+1, ...`` in blocks of ``m*D``, rank ``r`` taking the ``r``-th
  ``m`` of each block. A global step of ``G`` samples is the contiguous
  range ``[k*G, (k+1)*G)`` whatever ``D`` is, so the count alone continues
  the stream exactly under any ``D``.
- ``'cyclic'`` (``MegatronPretrainingRandomSampler``): epochs of
  ``A = N - N % (m*D)`` samples; epoch ``e = C // A`` resumes at ``C % A``,
  which must be whole micro-batches of ``m*D`` (Megatron asserts it).
  Without ``data_sharding`` the epoch is a permutation of the first
  ``(N // m) * m`` indices seeded by ``e``, read in blocks of ``m*D``: the
  same stream under another layout as long as ``(N // m) * m`` is unchanged
  and the count falls at the same epoch and offset (in epoch 0 with an
  unchanged global batch; later when ``A`` does not change). With ``data_sharding`` (its
  default) rank ``r`` shuffles its own bucket ``[r*B, (r+1)*B)``, ``B = (N //
  (m*D)) * m``: the buckets depend on ``D``, so mid-epoch no count puts the
  new ranks where the saved ones stood; only an epoch boundary continues
  (each sample of the next epochs read once, in another order than the
  uninterrupted run).

:class:`MegatronLMData` is the state entry (``{"data": MegatronLMData(args)}``)
whose ``state_dict`` is those counters; :class:`MegatronLMResharder`
(registered as kind ``"megatron_lm"``) records the sampler settings as the
position at every save and, at a load under another data-parallel size,
restores the counters when the stream continues exactly, else refuses
naming the samples that would repeat or be skipped. Called through
:mod:`bytecp.data` on every rank (save: the position; load, match phase:
the decision, before anything changes).
"""

from __future__ import annotations

from typing import Any

from bytecp.data import DataReshardError, Resharded, Resharder, SavedData
from bytecp.errors import ConfigError

__all__ = ["MegatronLMData", "MegatronLMResharder", "COUNTERS", "cyclic_epoch"]

#: Megatron-LM's data counters in ``args``, as its own ``load_checkpoint`` restores them
COUNTERS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")
#: the largest dataset whose repeated and skipped samples a refusal counts one by one
_COUNT_LIMIT = 1 << 24


def _dp_size() -> int:
    """The data-parallel size of this job: Megatron-Core's, else the world's."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return int(parallel_state.get_data_parallel_world_size())
    except ImportError:
        pass
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class MegatronLMData:
    """Megatron-LM's data position in a bytecp state: ``args``' data counters.

    ``args``: Megatron-LM's arguments (``megatron.training.get_args()``), whose
    ``consumed_train_samples``, ``skipped_train_samples`` and
    ``consumed_valid_samples`` are saved and restored (as Megatron-LM's own
    ``load_checkpoint`` does), read with ``dataloader_type``,
    ``data_sharding``, ``micro_batch_size``, ``global_batch_size`` and
    ``data_parallel_size``. ``loader``: the training data loader (its batch
    sampler's ``total_samples`` is the dataset length a ``'cyclic'`` sampler's
    epochs need), or ``total_samples`` given directly. Load before Megatron-LM
    builds its data iterators, as Megatron-LM does.
    """

    def __init__(self, args: Any, loader: Any = None, *, total_samples: int | None = None) -> None:
        missing = [c for c in ("consumed_train_samples", "micro_batch_size") if not hasattr(args, c)]
        if missing:
            raise ConfigError(f"MegatronLMData: args has no {', '.join(missing)}; pass Megatron-LM's arguments "
                              "(megatron.training.get_args())")
        self.args = args
        if total_samples is None and loader is not None:
            sampler = getattr(loader, "batch_sampler", None) or loader
            got = getattr(sampler, "total_samples", None)
            total_samples = int(got) if got is not None else None
        self.total_samples = total_samples

    # ------------------------------------------------------------------ what the sampler reads
    @property
    def sampler(self) -> str:
        """``args.dataloader_type``: ``"single"`` (also when unset), ``"cyclic"`` or ``"external"``."""
        return str(getattr(self.args, "dataloader_type", None) or "single")

    @property
    def data_sharding(self) -> bool:
        return bool(getattr(self.args, "data_sharding", True))

    @property
    def micro_batch_size(self) -> int:
        return int(self.args.micro_batch_size)

    @property
    def dp_size(self) -> int:
        dp = getattr(self.args, "data_parallel_size", None)
        return int(dp) if dp else _dp_size()

    def position(self) -> dict[str, Any]:
        """(save, every rank) The position: global, alike on every rank."""
        c, dp = int(self.args.consumed_train_samples), self.dp_size
        pos: dict[str, Any] = {"sampler": self.sampler, "consumed": c, "samples": c // dp, "dp_size": dp,
                               "batch_size": self.micro_batch_size}
        gbs = getattr(self.args, "global_batch_size", None)
        if gbs is not None:
            pos["global_batch_size"] = int(gbs)
        if self.sampler == "cyclic":
            pos["data_sharding"] = self.data_sharding
            if self.total_samples is not None:
                pos["dataset_len"] = self.total_samples
                epoch, _ = cyclic_epoch(c, self.total_samples, self.micro_batch_size, dp)
                pos["epoch"] = epoch
        return pos

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, int]:
        return {c: int(getattr(self.args, c, 0) or 0) for c in COUNTERS}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for c in COUNTERS:
            if sd.get(c) is not None:
                setattr(self.args, c, int(sd[c]))


def cyclic_epoch(consumed: int, n: int, m: int, dp: int) -> tuple[int, int]:
    """(epoch, offset in it) where Megatron's cyclic sampler at micro-batch
    ``m`` and ``dp`` ranks puts ``consumed`` samples of a dataset of ``n``."""
    active = n - n % (m * dp)
    if active <= 0:
        raise DataReshardError(f"a dataset of {n} samples holds no micro-batch of {m} on {dp} data-parallel ranks")
    return consumed // active, consumed % active


def _reads(n: int, m: int, dp: int, epoch: int, offset: int, sharding: bool, *, before: bool) -> Any:
    """(a bool mask over the dataset) What Megatron's cyclic sampler at
    micro-batch ``m`` and ``dp`` ranks reads of ``epoch`` before ``offset``
    (``before``), or from it to the epoch's end."""
    import torch

    g = torch.Generator()
    g.manual_seed(epoch)
    mask = torch.zeros(n, dtype=torch.bool)
    if not sharding:
        perm = torch.randperm((n // m) * m, generator=g)
        mask[perm[:offset] if before else perm[offset:n - n % (m * dp)]] = True
        return mask
    bucket = (n // (m * dp)) * m
    perm = torch.randperm(bucket, generator=g)
    part = perm[:offset // dp] if before else perm[offset // dp:]
    for r in range(dp):
        mask[r * bucket + part] = True
    return mask


class MegatronLMResharder(Resharder):
    """:class:`MegatronLMData` (registered as ``"megatron_lm"``)."""

    kind = "megatron_lm"

    def detect(self, obj: Any) -> bool:
        return isinstance(obj, MegatronLMData)

    def position(self, obj: Any, state: Any) -> dict[str, Any]:
        return obj.position()

    def same_layout(self, obj: Any, position: dict[str, Any]) -> bool:
        return (position.get("dp_size"), position.get("batch_size"), position.get("sampler")) == (
            obj.dp_size, obj.micro_batch_size, obj.sampler)

    def reshard(self, obj: Any, saved: SavedData, rank: int, world_size: int) -> Any:
        try:
            sampler, consumed = saved.value("sampler"), int(saved.value("consumed"))
            dp, m = int(saved.value("dp_size")), int(saved.value("batch_size"))
        except ValueError as e:
            raise DataReshardError(f"the saved ranks differ in {e} (Megatron-LM's counters are global): an "
                                   "unknown number of samples would repeat or be skipped") from None
        state = saved.state(saved.template_rank(rank))  # the counters, alike on every saved rank
        if sampler != obj.sampler:
            raise DataReshardError(f"saved with dataloader_type={sampler!r}, loaded with {obj.sampler!r}: another "
                                   "order, an unknown number of samples would repeat or be skipped")
        new_dp, new_m = obj.dp_size, obj.micro_batch_size
        if sampler == "single":  # one global order: the count continues it under any layout
            return state
        if sampler != "cyclic":
            raise DataReshardError(f"dataloader_type={sampler!r} passes the job's own loader through, whose "
                                   "position Megatron-LM does not keep: put that loader in the state instead; "
                                   "an unknown number of samples would repeat or be skipped")
        return self._cyclic(obj, saved, state, consumed, m, dp, new_m, new_dp)

    @staticmethod
    def _cyclic(obj: MegatronLMData, saved: SavedData, state: Any, c: int, m: int, dp: int, new_m: int,
                new_dp: int) -> Any:
        n = saved.value("dataset_len")
        sharding = bool(saved.value("data_sharding"))
        if n is None:
            raise DataReshardError(
                "dataloader_type='cyclic' saved without the dataset length its epochs need (MegatronLMData(args, "
                "loader=train_dataloader) records it): an unknown number of samples would repeat or be skipped")
        n = int(n)
        if obj.total_samples is not None and obj.total_samples != n:
            raise DataReshardError(f"the dataset holds {obj.total_samples} samples here, {n} when saved: another "
                                   "order, an unknown number of samples would repeat or be skipped")
        e, off = cyclic_epoch(c, n, m, dp)
        e2, off2 = cyclic_epoch(c, n, new_m, new_dp)
        old_len, new_len = n - n % (m * dp), n - n % (new_m * new_dp)
        where = (f"{c} consumed samples stand at sample {off} of epoch {e} on {dp} data-parallel ranks "
                 f"(micro-batch {m}), Megatron's cyclic sampler reads them as sample {off2} of epoch {e2} on "
                 f"{new_dp} (micro-batch {new_m})")
        if off2 % (new_m * new_dp):
            raise DataReshardError(f"{where}: {off2} samples are not whole micro-batches of {new_m} x {new_dp} "
                                   "ranks (Megatron's sampler asserts they are): an unknown number of samples would "
                                   "repeat or be skipped")
        # the epoch's order: sharded, each rank's bucket; else a permutation of the whole micro-batches
        same_order = (new_m, new_dp) == (m, dp) if sharding else (n // m) * m == (n // new_m) * new_m
        tail = None if new_len == old_len else (
            f"epoch {e} ends as {new_dp} data-parallel ranks end it: {new_len} samples instead of {old_len} "
            "(Megatron's cyclic sampler leaves out the epoch's last partial micro-batches)")
        if (e2, off2) == (e, off) and same_order:
            return Resharded(state, note=tail)
        if (e2, off2) == (e, off) and off == 0:  # an epoch boundary: each sample once per epoch, another order
            why = f"{new_dp} ranks' buckets" if sharding else f"a permutation of {(n // new_m) * new_m} samples"
            return Resharded(state, note=(
                f"from epoch {e} on, Megatron's cyclic sampler orders each epoch by {why}: every sample is read "
                f"once per epoch, in other global steps than the uninterrupted run on {dp} ranks"
                + (f"; {tail}" if tail else "")))
        why = (f"with data_sharding each rank shuffles its own bucket, which {new_dp} ranks cut elsewhere"
               if sharding else
               f"epoch {e2} permutes {(n // new_m) * new_m} samples, not {(n // m) * m}" if not same_order else
               "the epochs are cut elsewhere")
        if n > _COUNT_LIMIT:
            raise DataReshardError(f"{where}; {why}: samples would repeat and be skipped (not counted over {n} "
                                   "samples)")
        done = _reads(n, m, dp, e, off, sharding, before=True)
        rest_old = _reads(n, m, dp, e, off, sharding, before=False)
        rest_new = _reads(n, new_m, new_dp, e2, off2, sharding, before=False)
        repeat, skip = int((done & rest_new).sum()), int((rest_old & ~rest_new).sum())
        raise DataReshardError(f"{where}; {why}: {repeat} sample(s) of epoch {e} would be seen twice and {skip} "
                               "skipped", repeat=repeat, skip=skip)
