#!/usr/bin/env bash
# `make wheel-check` (run by `make test`, so by CI): bytecp as a user installs it.
#
# Builds the sdist and the wheel (setuptools' own backend, no network), checks
# that the wheel holds every module of the tree, installs the wheel -- not
# editable -- into a fresh virtualenv with the runtime dependencies only
# (torch through constraints.txt), and from a folder outside the checkout runs
# tools/wheel_smoke.py: every module imported (or refused with one line naming
# the extra to install), every CLI subcommand's --help, and a save -> load ->
# iter_weights -> follow round trip. The venv and the built files live in a
# temporary folder removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/bytecp-wheel-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
# the sdist from the checkout (the backend writes bytecp.egg-info/ beside the
# sources: removed only if it made it), the wheel from the unpacked sdist, as
# pip builds it for a user: nothing stale from an earlier build/ can slip in
made=()
for d in bytecp.egg-info; do [ -e "$d" ] || made+=("$d"); done
if ! "$PY" - "$work" >"$work/build.log" 2>&1 <<'PYEOF'
import os, sys, tarfile
from setuptools import build_meta as backend
work = sys.argv[1]
dist = os.path.join(work, "dist")
sdist = backend.build_sdist(dist)
with tarfile.open(os.path.join(dist, sdist)) as t:
    t.extractall(os.path.join(work, "src"), filter="data")
os.chdir(os.path.join(work, "src", sdist[: -len(".tar.gz")]))
print("wheel-check: built", sdist, "and, from it,", backend.build_wheel(dist))
PYEOF
then
    cat "$work/build.log"; echo "wheel-check: FAIL building the sdist and wheel" >&2; exit 1
fi
for d in "${made[@]}"; do rm -rf "$d"; done
tail -1 "$work/build.log"
"$PY" tools/wheel_smoke.py --check-wheel "$work"/dist/bytecp-*.whl
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt "$work"/dist/bytecp-*.whl 2>&1 \
    | { grep -v "WARNING: Location" || true; }
mkdir -p "$work/outside"
cp tools/wheel_smoke.py "$work/outside/"
(cd "$work/outside" && env -u PYTHONPATH PATH="$work/venv/bin:$PATH" "$work/venv/bin/python" -I wheel_smoke.py)
