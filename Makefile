# Two entry points (README): `make demo` and `make test`. Every pip install
# here goes through constraints.txt, which pins torch to the CPU build.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip install --disable-pip-version-check -q -c constraints.txt
PYTEST_ARGS ?=
# pytest workers (pytest-xdist), a test file's tests on one of them (their
# module-scoped jobs run once): two for make check and bench-check, whose tests
# keep the CPU busy; three for make test, whose ranks often wait (deadlines,
# servers, sleeps: a third worker fills those idle cores, docs/contributing.md).
# XDIST= runs the tests in this process
XDIST ?= -n 2 --dist loadfile
SUITE_XDIST ?= $(if $(strip $(XDIST)),-n 3 --dist loadfile,)

.PHONY: demo test bench-check check wheel-check install install-test megatron-install deepspeed-install torchtitan-install titan-install test-servers lint typecheck bench bench-s3 gpu-check clean

$(VENV)/.created:
	$(PY) -m venv $(VENV)
	touch $@

# bytecp/format/_kernels.c, _reads.c: an editable install builds the compiled kernels in place; rebuilt when they change
$(VENV)/.installed: $(VENV)/.created pyproject.toml constraints.txt bytecp/format/_kernels.c bytecp/format/_reads.c
	$(PIP) torch==2.13.0
	$(PIP) -e .
	touch $@

$(VENV)/.demo-installed: $(VENV)/.installed
	$(PIP) -e ".[demo,fast]"
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PIP) -e ".[test,s3,monitoring,lightning,fast]"
	$(MAKE) megatron-install
	$(MAKE) deepspeed-install
	$(MAKE) torchtitan-install
	touch $@

# Megatron-Core (adapter tests): --no-deps so it can never pull torch or CUDA
# wheels; its other requirements (numpy, packaging, psutil) are pinned here.
megatron-install: $(VENV)/.installed
	$(PIP) --no-deps megatron-core packaging psutil

# DeepSpeed (ZeRO adapter tests): --no-deps for the same reason, and
# DS_BUILD_OPS=0 builds no kernels (its CPU accelerator needs none); its
# other requirements are listed here, pinned in constraints.txt.
deepspeed-install: $(VENV)/.installed
	DS_BUILD_OPS=0 $(PIP) --no-deps deepspeed hjson msgpack ninja py-cpuinfo einops packaging psutil pydantic pydantic-core annotated-types typing-inspection tqdm

# torchtitan 0.3.0 (its checkpoint manager's tests with its trainer, and its Llama3
# and parallelisms in the DTensor layout matrix): --no-deps for the same reason, and
# because its datasets<4.8 pin would downgrade fsspec below s3fs's; what its trainer
# imports (the `torchtitan` extra) comes under the pins. titan-install: the same.
torchtitan-install: $(VENV)/.installed
	$(PIP) --no-deps torchtitan==0.3.0
	$(PIP) -e ".[torchtitan]"

titan-install: torchtitan-install

install: $(VENV)/.installed

install-test: $(VENV)/.test-installed

# The real servers the tests use (Ceph RGW, Prometheus), installed from
# Debian where we are root; the fixtures skip with that reason elsewhere.
test-servers:
	bash tools/install-test-servers.sh

# the whole story (README): FSDP2 on 2 processes, one killed mid-save, restarts
# on 1 (FSDP2) and 3 (DDP), stall table, export, evaluation job; a minute or two
demo: $(VENV)/.demo-installed
	$(VPY) -m bytecp.cli demo --out demo-out

# every test but the benchmarks' smoke runs (docs/contributing.md: how to write a
# fast one); the 25 slowest listed at the end, where a slow newcomer shows
test: install-test test-servers wheel-check
	$(VPY) -m pytest -q $(SUITE_XDIST) -m "not bench" --durations=25 $(PYTEST_ARGS)

# every benchmark script run on its tiny config (-m bench): each still runs and
# reports every field; nothing about speed is asserted. CI runs it after make test
bench-check: install-test test-servers
	$(VPY) -m pytest -q $(XDIST) -m bench --durations=10 $(PYTEST_ARGS)

# what ruff checks: tests/dist named as well (ruff's default exclude skips any folder called dist)
LINT_PATHS = bytecp adapters storage monitoring tests tests/dist benchmarks deploy proto

# the inner loop (2 minutes is the target: docs/contributing.md): ruff, mypy, and the tests that start no
# process (-m "not spawn": tests/spawning.py marks and checks the others), benchmarks' smoke runs left to bench-check
check: install-test
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/mypy
	$(VPY) -m pytest -q $(XDIST) -m "not spawn and not bench" --durations=10 $(PYTEST_ARGS)

# bytecp as a user installs it: the sdist and the wheel built, the wheel installed
# (not editable) into a fresh venv with the runtime dependencies only, every module
# imported, every subcommand's --help, a save/load/iter_weights/follow round trip
wheel-check: $(VENV)/.installed
	PY=$(VPY) bash tools/wheel-check.sh

lint: install-test
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/mypy

bench: install-test
	$(VPY) -m benchmarks.run
	$(VPY) -m benchmarks.training --out training.json --png training.png
	$(VPY) -m benchmarks.scale --out scale.json
	$(VPY) -m benchmarks.scale_megatron --out scale_megatron.json

bench-s3: install-test test-servers
	$(VPY) -m benchmarks.s3_bench

# the CUDA tests and the GPU benchmark beside DCP, on a machine with a GPU
# (its own python3 and torch there; bytecp's missing needs as wheels in
# .whl/: docs/benchmarks.md "GPU"); JSON and table to $$OUT. No GPU: exits 0
gpu-check:
	bash tools/gpu-check.sh

clean:
	rm -rf $(VENV) demo-out .pytest_cache
