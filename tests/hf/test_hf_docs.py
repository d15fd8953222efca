"""The Hugging Face snippets of docs/integrations.md run as written: the
one-process snippet here; the FSDP2 one under ``torchrun`` with 2 ranks
(slow: one spawned job)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist.pool import free_port

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"

pytestmark = pytest.mark.timeout(300)


def _snippets() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("# Hugging Face: transformers checkpoints as a load source"):]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_one_process_snippet_runs() -> None:
    exec(compile(_snippets()[0], f"{DOC}:hf-snippet-1", "exec"), {})  # noqa: S102 - our own docs


@pytest.mark.slow
def test_fsdp2_snippet_runs_under_torchrun(tmp_path: Path) -> None:
    first, second = _snippets()[:2]
    exec(compile(first, f"{DOC}:hf-snippet-1", "exec"), {})  # noqa: S102 - it saves /tmp/tiny-llama
    script = tmp_path / "fsdp2.py"
    script.write_text(second)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(script)]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
