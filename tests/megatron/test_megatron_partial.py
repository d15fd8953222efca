"""A load that fills a Megatron model but not its optimizer's fp32 main
(master) parameters, on real gloo ranks (DP=2, bf16 under Float16Module):
the optimizer excluded, not passed, or absent from the checkpoint under
``strict=False``. The next ``optimizer.step()`` must start from the loaded
weights, bitwise as after Megatron's own ``reload_model_params()`` (what its
loader calls when it loads no optimizer); before the adapter refreshed the
mains, it copied the fresh job's stale mains plus the update over them.
The cases run on the pool in ``master_cases``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from spawning import spawns

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (make test installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import master_cases as ms  # noqa: E402
import megatron_cases as mc  # noqa: E402
from dist.pool import WorkerPool  # noqa: E402

pytestmark = pytest.mark.timeout(600)

#: (case, which checkpoint, the distributed optimizer or Float16OptimizerWithFloat16Params)
CASES = [
    ("exclude", "full", True),
    ("model_only", "model", True),
    ("not_saved", "model", True),
    ("exclude", "full", False),
    ("model_only", "model", False),
]


@pytest.fixture(scope="module")
@spawns
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(2, env={"PYTHONWARNINGS": "ignore"})
    yield p
    p.close()


def test_partial_loads_step_from_the_loaded_weights(pool: WorkerPool, tmp_path: Path) -> None:
    urls = {"full": str(tmp_path / "full"), "model": str(tmp_path / "model")}
    saved = pool.run(ms.save_trained, urls["full"], urls["model"])[0]["model"]
    for case, which, dist_opt in CASES:
        what = f"{case} ({which} checkpoint, {'distributed' if dist_opt else 'Float16'} optimizer)"
        got = pool.run(ms.load_partial, urls[which], case, dist_opt=dist_opt)[0]
        ref = pool.run(ms.load_partial, urls[which], case, dist_opt=dist_opt, reload=True)[0]
        for k, v in saved.items():
            assert v.dtype == torch.bfloat16, k
            assert torch.equal(got["loaded"][k], v), f"{what}: {k} not loaded"
            assert torch.equal(got["stepped"][k], ref["stepped"][k]), f"{what}: {k} after the step"
            # one Adam step (lr 1e-2) from the loaded weights, plus bf16 rounding
            moved = float((got["stepped"][k].float() - v.float()).abs().max())
            assert moved < 0.02, f"{what}: {k} moved {moved} in one step"


def test_bare_module_with_sharded_mains_is_refused_before_the_load(pool: WorkerPool, tmp_path: Path) -> None:
    url = str(tmp_path / "model")
    pool.run(ms.save_trained, str(tmp_path / "full"), url)
    errors = pool.run(ms.load_bare, url)
    for err in errors:
        assert "cannot tell which range" in err and "reload_model_params()" in err, err


def test_megatron_layout_missing_part_of_its_state_is_refused(pool: WorkerPool, tmp_path: Path) -> None:
    # Megatron's loader would copy its unfilled (torch.empty) buffers into the
    # state; at fp32 the distributed optimizer's mains are the model's memory
    url = str(tmp_path / "dp")
    pool.run(mc.save_optimizer_reference, url, layout="dp_reshardable", tp=1)
    for err in pool.run(ms.load_dp_reshardable_part, url):
        assert "cannot load part of a state" in err and "exclude=['optimizer']" in err, err
