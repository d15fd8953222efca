"""The coordinator's part of the commit: ``metadata.json`` and the index
from every rank's output.

Called by the save pipeline's commit step (coordinator only, after the
gather of every rank's :class:`~bytecp.saving.writer.RankOutput`): the state's
skeleton and tensor specs (merged with those of ranks whose state differs,
which must agree on every tensor they share), the object records, the data
files, and the index built and checked by :mod:`bytecp.format.index_build`. The
pipeline then writes the index and commits ``metadata.json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bytecp.errors import CheckpointExistsError, ConfigError
from bytecp.format import metadata as fmt
from bytecp.format.chunk_batch import ChunkBatch
from bytecp.format.index_build import BuiltIndex, build_index
from bytecp.saving.writer import RankOutput
from bytecp.storage_api import Storage
from bytecp.tree.dtypes import dtype_name
from bytecp.tree.skeleton import Node
from bytecp.tree.state import FlatTree, merge_aliases

__all__ = ["build_metadata", "check_target", "tensor_specs"]


def check_target(storage: Storage, overwrite: bool) -> fmt.Metadata | None:
    """(coordinator, plan) Refuse a committed checkpoint unless overwriting; the one replaced."""
    if not storage.exists(fmt.METADATA_FILE):
        return None
    if not overwrite:
        raise CheckpointExistsError(
            f"{storage.url} already holds a committed checkpoint; pass overwrite=True "
            "to replace it (the old one stays intact until the new one commits)"
        )
    try:
        return fmt.Metadata.from_bytes(storage.read_bytes(fmt.METADATA_FILE), storage.url)
    except Exception:
        return None  # an unreadable old checkpoint is simply replaced


def tensor_specs(flat: FlatTree) -> dict[str, dict[str, Any]]:
    """Every tensor's dtype and global shape, as ``metadata.json`` lists them."""
    return {
        fqn: {"dtype": dtype_name(leaf.dtype), "shape": list(leaf.global_shape)}
        for fqn, leaf in flat.tensors.items()
    }


def build_metadata(
    outputs: Sequence[RankOutput],
    flat: FlatTree,
    coordinator: int,
    *,
    save_id: str,
    world_size: int,
    framework: str,
    parallelism: dict[str, Any],
    step: int | None,
    user_metadata: dict[str, Any],
    version: str,
) -> tuple[fmt.Metadata, BuiltIndex]:
    """(coordinator) ``metadata.json`` and the index. Raises
    :class:`ConfigError` when ranks describe a tensor differently or their
    chunks do not make up the tensors exactly."""
    skeleton = flat.skeleton
    tensors = tensor_specs(flat)
    for r, out in enumerate(outputs):
        if out.skeleton is None or out.tensors is None:
            continue
        skeleton = skeleton.merge(Node.from_json(out.skeleton))
        for fqn, spec in out.tensors.items():
            seen = tensors.setdefault(fqn, spec)
            if seen != spec:
                raise ConfigError(
                    f"tensor {fqn!r}: rank {coordinator} has dtype {seen['dtype']} shape {seen['shape']} but "
                    f"rank {r} has dtype {spec['dtype']} shape {spec['shape']}; every rank must describe the "
                    "same global tensor"
                )
    aliases = merge_aliases(flat.aliases, [(r, out.aliases) for r, out in enumerate(outputs)
                                           if out.aliases is not None], tensors, coordinator)
    objects: dict[str, fmt.ObjectRecord] = {}
    for r in [coordinator, *(r for r in range(len(outputs)) if r != coordinator)]:
        for fqn, rec in outputs[r].objects.items():
            objects.setdefault(fqn, rec)
    per_rank: dict[str, dict[int, fmt.ObjectRecord]] = {}
    data_files: dict[str, int] = {}
    for r, out in enumerate(outputs):
        for fqn, rec in out.per_rank.items():
            per_rank.setdefault(fqn, {})[r] = rec
        data_files.update(out.data_files)
    index = build_index([out.batch or ChunkBatch.empty() for out in outputs], tensors, data_files, save_id)
    for fqn, d in index.band_dims.items():
        tensors[fqn] = {**tensors[fqn], "band_dim": d}
    md = fmt.Metadata(
        save_id=save_id,
        world_size=world_size,
        framework=framework,
        parallelism=parallelism,
        skeleton=skeleton,
        tensors=tensors,
        objects=objects,
        per_rank=per_rank,
        index_files=[],
        data_files=data_files,
        step=step,
        user_metadata=user_metadata,
        bytecp_version=version,
        index=index.directory,
        aliases=aliases,
        # version 3: "../<checkpoint>/data/<save_id>/<file>" -> the checkpoint and its save
        references={p.split("/")[1]: p.split("/")[3] for p in data_files if p.startswith("../")},
    )
    return md, index
