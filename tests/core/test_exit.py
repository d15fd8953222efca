"""Nothing aborts at interpreter exit: a one-process script whose async saves
(eager and lazy, through CheckpointManager) are still running when ``main``
returns exits 0, every checkpoint committed and retention finished.

The abort this guards against (*terminate called without an active
exception*, SIGABRT) came from the save's daemon thread still running C++
code (torch, pyarrow) once finalization had begun: CPython ends such a
thread with ``pthread_exit`` when it next takes the GIL, and the forced
unwind through a ``noexcept`` C++ frame calls ``std::terminate``. The exit
hook in :mod:`bytecp.saving.handles` now joins the thread first.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawn

# The script of a user: save through the manager, return from main. The
# parent imports torch and bytecp once and forks one child per run; each
# child runs the script and leaves through the interpreter's normal
# finalization (it falls off the end of the module), so a run costs the
# saves, not the imports.
SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch._dynamo  # what building the optimizer imports: once, before the forks
    import bytecp

    def main(run, lazy, slow_callback):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=2, async_save=True, lazy=lazy)
        for step in range(1, 4):
            model(torch.randn(8, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            handle = mgr.maybe_save(step, {"model": model, "optim": opt}) and mgr._pending
        if slow_callback:  # C++ work (GIL released) on the save's thread after main returns
            def busy(_h):
                a = torch.randn(600, 600)
                t = time.time()
                while time.time() - t < 1.0:
                    a = (a @ a).tanh()
            handle.add_done_callback(busy)

    runs, base, slow = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    for i in range(runs):
        pid = os.fork()
        if pid == 0:
            main(f"{base}/run-{i}", lazy=bool(i % 2), slow_callback=slow)
            break
        _, status = os.waitpid(pid, 0)
        print(f"run-{i} exit {os.waitstatus_to_exitcode(status)}", flush=True)
""")


def run_script(tmp_path: Path, runs: int, slow_callback: bool) -> list[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    p = subprocess.run(
        [sys.executable, str(script), str(runs), str(tmp_path), "1" if slow_callback else "0"],
        capture_output=True, text=True, timeout=240,
    )
    assert "terminate called" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.splitlines()


def assert_clean(tmp_path: Path, runs: int, exits: list[str]) -> None:
    assert exits == [f"run-{i} exit 0" for i in range(runs)], exits
    for i in range(runs):
        run = tmp_path / f"run-{i}"
        # retention ran to its end: exactly the last two committed, nothing half-deleted
        assert sorted(p.name for p in run.iterdir()) == ["step-2", "step-3"], (i, list(run.iterdir()))
        assert all((run / s / "metadata.json").exists() for s in ("step-2", "step-3"))


def test_a_done_callback_still_running_at_exit_finishes_before_finalization(tmp_path: Path) -> None:
    """Deterministic: before the fix this run aborted every time."""
    exits = run_script(tmp_path, 2, slow_callback=True)
    assert_clean(tmp_path, 2, exits)


@pytest.mark.slow
def test_many_exits_eager_and_lazy_are_all_clean(tmp_path: Path) -> None:
    runs = 8
    exits = run_script(tmp_path, runs, slow_callback=False)
    assert_clean(tmp_path, runs, exits)


LEASE_SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    import torch
    import bytecp

    url = sys.argv[1]
    handle = bytecp.async_save(url, {"a": torch.zeros(4)})

    def held(d):  # (the folder goes with the last lease: it may vanish between two looks)
        try:
            return bool(os.listdir(d))
        except FileNotFoundError:
            return False

    def watch():  # not a daemon: joined after threading's exit hooks ran
        gone = False
        d = os.path.join(url, "leases")
        while not handle.done() and not held(d):
            time.sleep(0.005)  # the lease is taken when the background save plans
        while not handle.done():
            if not held(d) and not os.path.exists(os.path.join(url, "metadata.json")):
                gone = True
                break
            time.sleep(0.01)
        print("lease gone while saving" if gone else "lease held", flush=True)

    threading.Thread(target=watch).start()
""")


def test_the_lease_of_a_save_drained_at_exit_is_held_until_it_ends(tmp_path: Path) -> None:
    """The lease's exit hook runs after the in-flight save's thread has ended,
    never before: else the files of a save still committing at exit are
    unprotected from `bytecp gc` and other jobs' sweeps."""
    import os

    script = tmp_path / "lease.py"
    script.write_text(LEASE_SCRIPT)
    env = {**os.environ, "BYTECP_FAULT_DELAY": "commit:0:1.5"}
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "lease held", p.stdout + p.stderr[-2000:]
    assert (tmp_path / "ck" / "metadata.json").exists()


# Two ranks per run, forked from a parent that imported torch and bytecp:
# each loads, destroys the default group (still held, as a model's FSDP2
# state holds its group) and leaves. The switch interval makes the rank keep
# the GIL from the load's last collective to finalization, as a script that
# ends right after its load does: a gloo worker that then frees that
# collective's tensors asks for the GIL too late and the rank aborts (before
# bytecp kept its works, bytecp.dist_raw: about 1 rank in 4).
LOAD_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    import bytecp

    url, runs, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    def main(rank, init):
        sys.setswitchinterval(60)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        held = dist.group.WORLD
        model = torch.nn.Linear(16, 16)
        bytecp.load(url, {"model": model})
        assert torch.equal(model.weight, torch.arange(256.0).reshape(16, 16))
        dist.destroy_process_group()

    for i in range(runs):
        init = f"file://{base}/store-{i}"
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                main(rank, init)
                sys.exit()  # finalizes as the end of a script does
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
        print(f"run-{i} exit {codes}", flush=True)
""")


@pytest.mark.slow
def test_many_exits_after_a_two_rank_load_are_all_clean(tmp_path: Path) -> None:
    import torch

    import bytecp

    model = torch.nn.Linear(16, 16)
    with torch.no_grad():
        model.weight.copy_(torch.arange(256.0).reshape(16, 16))
    bytecp.save(str(tmp_path / "ck"), {"model": model})
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    runs = 6
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), str(runs), str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert "terminate called" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == [f"run-{i} exit [0, 0]" for i in range(runs)], p.stdout + p.stderr[-2000:]


def test_a_roll_call_still_waiting_in_the_store_ends_before_finalization(tmp_path: Path) -> None:
    """A roll call whose store request is still blocked at exit (its host was
    stopped and has just come back) is waited for before the interpreter
    finalizes: returning into Python during finalization would abort."""
    script = textwrap.dedent("""
        import threading, time
        from bytecp import dist_raw

        class SlowStore:  # a store whose host answers 1.5 s late
            def append(self, key, value):
                time.sleep(1.5)
            def add(self, key, n):
                return 1
            def wait(self, keys, timeout):
                pass
            def get(self, key):
                open(OUT, "w").write("answered")
                return b"0,"

        try:
            dist_raw.roll_call(SlowStore(), "p/", 0, 2, seconds=-1.9)  # gives up after 0.1 s
        except dist_raw.StoreSilent:
            print("silent")
    """).replace("OUT", repr(str(tmp_path / "out")))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "silent" in done.stdout, done.stderr
    assert (tmp_path / "out").read_text() == "answered"  # the abandoned call ran to its end before exit
    assert "waiting (at most 15 s) for a roll call" in done.stderr
