#!/usr/bin/env bash
# `make gpu-check`: the CUDA tests and the GPU benchmark beside DCP (benchmarks/gpu_check.py).
#
# Runs with the project's .venv where there is one, else python3 (a GPU
# machine's own torch). Wheels in .whl/ (bytecp's needs that machine lacks,
# such as crc32c; see docs/benchmarks.md "GPU") are installed into a
# folder of their own first, and the project itself is installed editable
# (no index, no build isolation) if it is not importable yet. Without CUDA
# the check says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import crc32c, fsspec, pyarrow, numpy, tqdm" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    site=${TMPDIR:-/tmp}/bytecp-gpu-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd / && "$PY" -c "import bytecp.adapters, bytecp.storage" 2>/dev/null); then
    if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ; then
        # no build backend there: map the packages of pyproject.toml's package-dir by hand,
        # for this process and every process it starts (sitecustomize on PYTHONPATH)
        shim=${TMPDIR:-/tmp}/bytecp-gpu-shim
        mkdir -p "$shim"
        cat >"$shim/sitecustomize.py" <<PYEOF
import importlib.abc, importlib.util, os, sys
_ROOT = "$PWD"
_MAP = {"bytecp.adapters": "adapters", "bytecp.storage": "storage", "bytecp.monitoring": "monitoring"}
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        for pkg, folder in _MAP.items():
            if name == pkg or name.startswith(pkg + "."):
                base = os.path.join(_ROOT, folder, *name[len(pkg):].split(".")[1:])
                if os.path.isdir(base):
                    return importlib.util.spec_from_file_location(
                        name, os.path.join(base, "__init__.py"), submodule_search_locations=[base])
                if os.path.isfile(base + ".py"):
                    return importlib.util.spec_from_file_location(name, base + ".py")
        return None
sys.meta_path.insert(0, _Finder())
PYEOF
        export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
export PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_check "$@"
