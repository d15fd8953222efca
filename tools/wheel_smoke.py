"""bytecp as a user installs it: run by tools/wheel-check.sh (``make wheel-check``,
part of ``make test``).

``--check-wheel WHEEL`` (run from the checkout, any Python): the wheel holds
every module of the tree, where ``pyproject.toml``'s package-dir maps it.

Without arguments (run with the Python of a fresh virtualenv holding the wheel
and the runtime dependencies only, from a folder outside the checkout):

1. bytecp is the installed copy, not the checkout;
2. every module of ``bytecp`` imports, or -- needing an extra that is not
   installed -- fails with one line naming the extra to install;
3. ``bytecp --help`` and every subcommand's ``--help`` exit 0 (or, needing an
   extra, 2 with that one line);
4. a save -> load -> ``iter_weights`` -> ``follow`` round trip, bitwise, and
   ``bytecp ls``/``inspect``/``verify``/``follow`` on the run.

Exits 1 naming every failure.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import zipfile

#: modules that need an extra (or pytest) the runtime-only install lacks
NEEDS_EXTRA = ("bytecp.monitoring.", "bytecp.adapters.lightning", "bytecp.adapters.torchtitan",
               "bytecp.adapters.testing", "bytecp.storage.testing", "bytecp.contract", "bytecp.demo.evaluate",
               "bytecp.adapters.data.torchdata", "bytecp.adapters.data.hf_")

failures: list[str] = []


def fail(msg: str) -> None:
    failures.append(msg)
    print(f"wheel-check: FAIL {msg}", file=sys.stderr)


def check_wheel(wheel: str) -> None:
    """Every .py of the mapped folders is in the wheel at its package path."""
    import tomllib

    with open("pyproject.toml", "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    roots = {folder: pkg for pkg, folder in dirs.items() if "." not in folder.strip("/").replace("/", ".", 0)
             and "/" not in folder}
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.endswith((".py", ".pyi"))}
    want = set()
    for folder, pkg in roots.items():
        for here, subdirs, files in os.walk(folder):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            rel = os.path.relpath(here, folder)
            base = pkg.replace(".", "/") + ("" if rel == "." else "/" + rel)
            want |= {f"{base}/{n}" for n in files if n.endswith((".py", ".pyi"))}
    for path in sorted(want - held):
        fail(f"{wheel}: lacks {path}; list its package in pyproject.toml [tool.setuptools] packages")
    print(f"wheel-check: the wheel holds {len(want & held)} of the tree's {len(want)} modules")
    # the compiled kernels of serving deltas and the checked reads: built wherever a C compiler is (optional
    # elsewhere)
    for module, what in (("_kernels", "kernels"), ("_reads", "checked reads")):
        built = [n for n in z.namelist() if n.startswith(f"bytecp/format/{module}") and n.endswith((".so", ".pyd"))]
        if shutil.which("cc") and not built:
            fail(f"{wheel}: lacks the compiled {what} bytecp/format/{module}*.so though a C compiler is here; "
                 "see pyproject.toml [tool.setuptools] ext-modules and the build log")


def check_installed() -> None:
    import bytecp

    here = os.path.dirname(bytecp.__file__)
    if not here.startswith(sys.prefix):
        fail(f"bytecp imported from {here}, not from the virtualenv {sys.prefix}")
    from bytecp.format import kernels

    if shutil.which("cc") and kernels.engine() != "c":
        fail(f"the installed wheel's serving deltas run on {kernels.engine()}, not its compiled kernels "
             "(bytecp.format._kernels missing, stale or failing its self-check)")
    print(f"wheel-check: serving-delta kernels: {kernels.engine()}")
    from bytecp.format import checked_reads

    if shutil.which("cc"):
        from bytecp.format import _reads  # (in the wheel: checked above)

        if _reads.HW and checked_reads.compiled() is None:
            fail("the installed wheel's checked reads (bytecp.format._reads) are stale or fail their self-check")
    print(f"wheel-check: checked reads: {'compiled' if checked_reads.compiled() else 'Python'}")


def check_imports() -> None:
    import bytecp

    n = 0
    for info in pkgutil.walk_packages(bytecp.__path__, "bytecp."):
        name = info.name
        try:
            importlib.import_module(name)
            n += 1
        except ModuleNotFoundError as e:
            msg = str(e)
            if not name.startswith(NEEDS_EXTRA) and not (name + ".").startswith(NEEDS_EXTRA):
                fail(f"import {name}: {msg} (a runtime module must import with the runtime dependencies)")
            elif "\n" in msg or "pip install 'bytecp[" not in msg or not msg.startswith("bytecp."):
                fail(f"import {name}: {msg!r} is not one line naming the module and the extra to install")
        except Exception as e:  # noqa: BLE001 - every failure is reported
            fail(f"import {name}: {type(e).__name__}: {e}")
    print(f"wheel-check: {n} modules imported")


def bytecp_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "bytecp")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def check_cli() -> None:
    from bytecp.cli import _EXTERNAL, _parser

    top = bytecp_cmd("--help")
    if top.returncode != 0:
        fail(f"bytecp --help exited {top.returncode}: {top.stderr.strip()}")
    sub = next(a for a in _parser()._actions if a.dest == "cmd")
    for name in sub.choices:  # type: ignore[union-attr]
        r = bytecp_cmd(name, "--help")
        lines = r.stderr.strip().splitlines()
        if r.returncode == 0 and "usage:" in r.stdout:
            continue
        if name in _EXTERNAL and r.returncode == 2 and len(lines) == 1 and "pip install" in lines[0]:
            print(f"wheel-check: bytecp {name} --help: {lines[0]}")
            continue
        fail(f"bytecp {name} --help exited {r.returncode}: {r.stdout[-300:]}{r.stderr[-500:]}")
    print(f"wheel-check: bytecp --help and {len(sub.choices)} subcommands' --help")  # type: ignore[arg-type]


def check_round_trip() -> None:
    import torch

    import bytecp

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=3)
        for step in (1, 2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.maybe_save(step, {"model": model, "optimizer": opt})
        mgr.wait()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        url = mgr.url_for(2)

        fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        bytecp.load(url, {"model": fresh, "optimizer": fresh_opt})
        for k, v in fresh.state_dict().items():
            if not torch.equal(v, want[k]):
                fail(f"load: {k} differs from the saved tensor")
        if fresh_opt.state_dict()["state"][0]["exp_avg"].ne(opt.state_dict()["state"][0]["exp_avg"]).any():
            fail("load: the optimizer's exp_avg differs")

        got = dict(bytecp.iter_weights(url))
        if sorted(got) != sorted(want) or any(not torch.equal(got[k], want[k]) for k in want):
            fail(f"iter_weights: {sorted(got)} differ from the saved weights {sorted(want)}")

        follower = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        updates = list(bytecp.follow(run, {"model": follower}, poll_s=0.1, idle_timeout_s=0.3))
        if not updates or updates[-1].error or updates[-1].step != 2:
            fail(f"follow: updates {updates}")
        for k, v in follower.state_dict().items():
            if not torch.equal(v, want[k]):
                fail(f"follow: {k} differs from step 2's")

        for args in (("ls", run), ("inspect", url), ("verify", url, "--no-progress"),
                     ("follow", run, "--json", "--poll-s", "0.1", "--idle-timeout-s", "0.3")):
            r = bytecp_cmd(*args)
            if r.returncode != 0:
                fail(f"bytecp {' '.join(args)} exited {r.returncode}: {r.stderr.strip()[-500:]}")
    print("wheel-check: save -> load -> iter_weights -> follow round trip, bitwise")


def main() -> int:
    if sys.argv[1:2] == ["--check-wheel"]:
        check_wheel(sys.argv[2])
    else:
        check_installed()
        check_imports()
        check_cli()
        check_round_trip()
    if failures:
        print(f"wheel-check: {len(failures)} failure(s)", file=sys.stderr)
        return 1
    print("wheel-check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
