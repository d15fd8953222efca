"""The Lightning plugin with ``lightning.pytorch`` (``import lightning as L``),
the namespace most users import now, in a process of its own: fit, save
through ModelCheckpoint, resume, and the same weights as an uninterrupted run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawn

# looked up, not imported: this process keeps using pytorch_lightning (test_lightning_io.py)
if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed (make test installs it)", allow_module_level=True)

WORKER = Path(__file__).with_name("lightning_namespace_worker.py")


@pytest.mark.timeout(300)
def test_lightning_pytorch_namespace_fits_saves_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, str(WORKER), str(run)], capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["package"] == "lightning.pytorch" and not res["pytorch_lightning_imported"]
    # the resume restored step 4 (it ran the last 2 steps only) and matches 6 uninterrupted steps bitwise
    assert res["latest"].endswith("step=4.ckpt") and res["resumed_steps"] == 2 and res["same"], res


def test_the_package_is_chosen_as_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    from bytecp.adapters.lightning import compat

    from bytecp.errors import ConfigError

    monkeypatch.setenv("BYTECP_LIGHTNING", "pytorch_lightning")
    assert compat.choose() == "pytorch_lightning"
    monkeypatch.setenv("BYTECP_LIGHTNING", "lightning")
    with pytest.raises(ConfigError, match="BYTECP_LIGHTNING"):
        compat.choose()
