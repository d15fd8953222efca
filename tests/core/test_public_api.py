"""The public import paths stay stable (and `import bytecp` does not import torch)."""

from __future__ import annotations

import subprocess
import sys

import bytecp


def test_public_names_resolve() -> None:
    for name in bytecp.__all__:
        assert getattr(bytecp, name) is not None, name
    for module in ("bytecp.storage", "bytecp.storage.testing", "bytecp.adapters", "bytecp.monitoring",
                   "bytecp.manager", "bytecp.cli", "bytecp.demo", "bytecp.options"):
        __import__(module)


def test_import_does_not_pull_torch() -> None:
    code = "import sys, bytecp, bytecp.monitoring; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_async_save_stays_callable_after_save(tmp_path) -> None:
    import torch

    bytecp.save(str(tmp_path / "a"), {"x": torch.zeros(1)})
    bytecp.async_save(str(tmp_path / "b"), {"x": torch.zeros(1)}).wait()
