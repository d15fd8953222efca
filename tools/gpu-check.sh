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
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
export PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_check "$@"
