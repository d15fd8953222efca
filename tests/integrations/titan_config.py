"""torchtitan config functions for the tests and the benchmark
(``--module tests.integrations.titan_config --config bytecp_debug``).

The llama3 debug model, small enough for 2 gloo processes: seq_len 64, batch 2, float32, compile
and activation checkpointing off. Assets (a tiny tokenizer, a c4_test-style
JSON-lines file) come from :func:`write_assets` via ``BYTECP_TITAN_ASSETS``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = ["write_assets", "bytecp_debug", "dcp_debug"]

_WORDS = ("the model saves its shards while training runs on every rank and loads them "
          "under another parallelism later with the same losses as before").split()


def write_assets(root: Path, docs: int = 400) -> Path:
    """A BPE tokenizer (vocab 512) and ``c4_test/c4_demo.json`` under ``root``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    texts = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(40, 120))) for _ in range(docs)]
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<|begin_of_text|>", "<|end_of_text|>"])
    tok.train_from_iterator(texts, trainer)
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}))
    (root / "c4_test").mkdir(exist_ok=True)
    with open(root / "c4_test" / "c4_demo.json", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return root


def _base(checkpoint):  # type: ignore[no-untyped-def]
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    assets = Path(os.environ["BYTECP_TITAN_ASSETS"])
    config = llama3_debugmodel()
    config.hf_assets_path = str(assets / "tokenizer")
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(assets / "c4_test"))
    config.training = TrainingConfig(local_batch_size=2, seq_len=64, steps=4, mixed_precision_param="float32",
                                     disable_cuda_graphs=True)
    config.parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    config.activation_checkpoint = None
    config.compile = CompileConfig(enable=False)
    config.validator = Validator.Config(enable=False)
    config.metrics = MetricsProcessor.Config(log_freq=1)
    config.debug.seed = 0
    config.checkpoint = checkpoint
    return config


def bytecp_debug():  # type: ignore[no-untyped-def]
    """The debug model checkpointed by bytecp: one config line."""
    from bytecp.adapters.torchtitan import BytecpCheckpointManager

    return _base(BytecpCheckpointManager.Config(enable=True, interval=2, last_save_model_only=False))


def dcp_debug():  # type: ignore[no-untyped-def]
    """The same run checkpointed by torch DCP (torchtitan's default manager)."""
    from torchtitan.components.checkpoint import CheckpointManager

    return _base(CheckpointManager.Config(enable=True, interval=2, last_save_model_only=False))
