"""Shared pieces of the export tests: a tiny GPT-2 from the real transformers
package, logits to compare, and a checkpoint whose metadata records a tied alias."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bytecp.format import metadata as fmt

VOCAB = 1000


def gpt2_config(vocab_size: int = VOCAB) -> Any:
    from transformers import GPT2Config

    # bos/eos inside the vocabulary, so transformers has nothing to warn about
    return GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=vocab_size,
                      bos_token_id=0, eos_token_id=0)


def tiny_gpt2(seed: int = 0, vocab_size: int = VOCAB) -> Any:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(vocab_size)).eval()


def config_dict(model: Any) -> dict[str, Any]:
    """The model's config as users save it: ``model.config.to_dict()``."""
    return dict(model.config.to_dict())


def logits(model: Any, vocab_size: int = VOCAB) -> torch.Tensor:
    x = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(x).logits


def record_alias(ck: Path, alias: str, stored: str) -> None:
    """Make the checkpoint at ``ck`` record ``alias`` as a tie to ``stored``
    (as a save does for tensors that share storage), if it does not already:
    the alias's tensor entry and its index rows go, ``aliases`` names it.
    The two tensors must hold the same values (they are tied)."""
    md = fmt.Metadata.from_bytes((ck / fmt.METADATA_FILE).read_bytes(), str(ck))
    if md.aliases.get(alias) == stored or md.aliases.get(stored) == alias:
        return  # the save recorded the tie already (either way round)
    assert alias in md.tensors and stored in md.tensors, (alias, stored, list(md.tensors))
    from bytecp.format.parts_build import build_whole
    from bytecp.loading.opened import open_checkpoint
    from bytecp.storage_api import open_storage

    chunks = [c for c in open_checkpoint(open_storage(str(ck))).all_rows() if c.fqn != alias]
    md.aliases[alias] = stored
    specs = {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in md.tensors.items() if k != alias}
    files, md.index = build_whole(chunks, specs, md.data_files, md.save_id)  # the index without it
    md.tensors = specs
    for path, blobs in files.items():
        (ck / path).write_bytes(b"".join(blobs))
    (ck / fmt.METADATA_FILE).write_bytes(md.to_bytes())


def untied(ck: Path, model: Any, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """``model``'s state dict without the tied aliases the checkpoint at ``ck``
    records below ``prefix`` (what an export writes: one copy of each tie)."""
    md = fmt.Metadata.from_bytes((ck / fmt.METADATA_FILE).read_bytes(), str(ck))
    aliases = {a[len(prefix):] for a in md.aliases if a.startswith(prefix)}
    return {k: v for k, v in model.state_dict().items() if k not in aliases}
