"""Every resume path x every run-folder condition, on local disk and on S3:
each cell is the outcome docs/guide.md's table promises (:data:`TABLE`).

Paths (each asks the one decision, :mod:`bytecp.tools.resume`):
``CheckpointManager.restore``; torchtitan's ``BytecpCheckpointManager.load()``,
``load_step=20`` and ``initial_load_path``; Lightning's ``latest_checkpoint``
and ``trainer.fit(ckpt_path="last")`` with ``BytecpModelCheckpoint``; ``bytecp
ls``; ``bytecp.follow``'s first update.

Conditions (the run's own checkpoints are steps 10 and 20, written by the
tool each path stands for: ``resume_artifacts.py``): the run folder missing
or empty; only bytecp checkpoints; beside them a newer ``step-30`` holding a
foreign file, an empty ``step-30``, a ``step-abc`` holding a file; a bytecp
save killed in its commit phase as ``step-30``; step 20's data corrupted (a
flipped byte); step 20's ``metadata.json`` not JSON; checkpoints of another
library only (the Hugging Face Trainer's ``checkpoint-N``; torchtitan's own
DCP ``step-N`` for torchtitan), and mixed (bytecp's 10, the other's 20);
listing refused; listing throttled (``503 SlowDown`` on every listing) and
timing out (listings never answered): retried, then raised.

S3 is moto behind the fault proxy (refused: ``403 AccessDenied``, what S3
answers a role without ``s3:ListBucket``), and Ceph RGW with a wrong secret
for a refusal by the real server. A local refusal is real too: the folder
mode 000, read with this thread's filesystem uid dropped to ``nobody`` when
the suite runs as root (``setfsuid``). Throttling and timeouts exist on S3
only (a local disk neither throttles nor times out). Lightning's
``ckpt_path="last"`` is local only: Lightning checks the path it is handed
with its own fsspec filesystem, which knows nothing of the S3 options
(an xfail on S3, with that reason).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_proxy import HANG, FaultProxy
from resume_artifacts import STEPS, LitModule, artifacts, plain_model, titan_manager  # noqa: F401

import bytecp
from bytecp.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ResumeDecisionError,
    StoragePermissionError,
    TransientStorageError,
)
from bytecp.storage_api import open_storage

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is installed by `make torchtitan-install`")
pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed (make test installs it)")

# spawn: every cell reads the session's artifacts, among them a save killed in
# its commit phase (a process of its own, resume_artifacts.py)
pytestmark = [pytest.mark.spawn, pytest.mark.timeout(600)]

NEWEST, OLDER = STEPS[-1], STEPS[0]
#: retried for 4 s at most (the default is 120 s)
FAST = {"retry": {"deadline": 4.0, "initial_backoff": 0.05, "max_backoff": 0.3}}
#: the cells whose listing always fails only need "retried, then raised":
#: throttled (503 at once) gives up after 0.3 s, several attempts; timeout (a
#: listing never answered) after two attempts of 0.3 s each (the deadline
#: allows a second attempt, not a third). The other requests of those cells
#: are healthy; one that took longer than 0.3 s on a loaded machine would be
#: retried, and raise the same TransientStorageError naming request_timeout
THROTTLED = {"retry": {"deadline": 0.3, "initial_backoff": 0.02, "max_backoff": 0.05}}
HANGS = {"request_timeout": 0.3, "retry": {"deadline": 0.4, "initial_backoff": 0.05, "max_backoff": 0.1}}
SHORT = {"throttled": THROTTLED, "timeout": HANGS}


@dataclasses.dataclass(frozen=True)
class Refused:
    """The path raises ``error`` matching ``match``."""

    error: type[BaseException]
    match: str = ""


#: condition -> what the decision says: "fresh", the step resumed, or Refused;
#: ``loads`` the step that loads when the first one tried does not (fallback);
#: ``foreign`` the step resumed is another library's
TABLE: dict[str, dict[str, Any]] = {
    "missing": {"decision": "fresh"},
    "empty": {"decision": "fresh"},
    "bytecp": {"decision": NEWEST},
    "stray_file": {"decision": Refused(ResumeDecisionError, r"no format bytecp reads \(.*/step-30\).*move them out")},
    "stray_empty": {"decision": NEWEST},
    "stray_unnamed": {"decision": Refused(ResumeDecisionError, r"step-abc .*name no step")},
    "killed_newest": {"decision": NEWEST},
    "corrupt_newest": {"decision": NEWEST, "loads": OLDER},
    "unreadable_metadata": {"decision": NEWEST, "loads": OLDER},
    "foreign_only": {"decision": NEWEST, "foreign": True},
    "mixed": {"decision": NEWEST, "foreign": True},
    "denied": {"decision": Refused(StoragePermissionError, r"(?i)denied|AccessDenied")},
    "throttled": {"decision": Refused(TransientStorageError, r"SlowDown|503")},
    "timeout": {"decision": Refused(TransientStorageError, r"request_timeout")},
}
S3_ONLY = {"throttled", "timeout"}
PATHS = ["restore", "titan_load", "titan_load_step", "titan_initial", "latest_checkpoint", "lightning_last", "ls",
         "follow"]


# ------------------------------------------------------------------ folders
def _kind(path: str) -> str:
    return "titan" if path.startswith("titan") else "lightning" if path.startswith(("latest", "lightning")) else "plain"


def _own(base: Path, kind: str, step: int) -> Path:
    return base / kind / (f"step-{step}.ckpt" if kind == "lightning" else f"step-{step}")


def _foreign(base: Path, kind: str, step: int) -> tuple[Path, str]:
    """Another library's checkpoint of that step, and its name in the run."""
    if kind == "titan":
        return base / "titan_dcp" / f"step-{step}", f"step-{step}"
    return base / f"{kind}_hf" / f"checkpoint-{step}", f"checkpoint-{step}"


def _flip(folder: Path) -> None:
    """A byte of the first chunk flipped (a data file's first chunk starts at its first byte)."""
    data = sorted(p for p in (folder / "data").rglob("*.bin"))[0]
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))


def build(base: Path, run: Path, kind: str, condition: str) -> None:
    """The run folder of ``condition`` at ``run`` (local), from the session's artifacts."""
    if condition == "missing":
        return
    run.mkdir(parents=True)
    if condition == "empty":
        return
    if condition in ("foreign_only", "mixed"):
        for step in STEPS if condition == "foreign_only" else STEPS[1:]:
            src, name = _foreign(base, kind, step)
            shutil.copytree(src, run / name)
        if condition == "mixed":
            shutil.copytree(_own(base, kind, OLDER), run / _own(base, kind, OLDER).name)
        return
    for step in STEPS:
        shutil.copytree(_own(base, kind, step), run / _own(base, kind, step).name)
    newest = run / _own(base, kind, NEWEST).name
    if condition == "stray_file":
        (run / "step-30").mkdir()
        (run / "step-30" / "notes.txt").write_text("copied from elsewhere")
    elif condition == "stray_empty":
        (run / "step-30").mkdir()
    elif condition == "stray_unnamed":
        (run / "step-abc").mkdir()
        (run / "step-abc" / "weights.bin").write_bytes(b"\0" * 64)
    elif condition == "killed_newest":
        shutil.copytree(base / "killed" / "step-30", run / "step-30")
    elif condition == "corrupt_newest":
        _flip(newest)
    elif condition == "unreadable_metadata":
        (newest / "metadata.json").write_text("{not json")


@dataclasses.dataclass
class Where:
    """Where a cell's run folder lives and how the paths reach it."""

    url: str
    options: dict[str, Any]
    #: torchtitan's initial_load_path: its bytecp step 10, outside the run folder
    seed: str
    #: the fault the condition injects while the path runs
    fault: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext


def _upload(local: Path, url: str, options: dict[str, Any]) -> None:
    """The local run folder's files under ``url``; an empty folder as the
    zero-byte ``name/`` object the S3 console makes for one."""
    if not local.exists():
        return
    head, _, name = url.rpartition("/")
    parent = open_storage(head, **options)
    for p in sorted(local.rglob("*")):
        rel = f"{name}/{p.relative_to(local).as_posix()}"
        if p.is_file():
            parent.write_file(rel, [p.read_bytes()])
        elif not any(p.iterdir()):
            parent.write_file(rel + "/", [b""])
    if not any(local.iterdir()):
        parent.write_file(name + "/", [b""])


_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def _refused(folder: Path) -> Iterator[None]:
    """The folder mode 000, and (as root, who reads anything) this thread's filesystem uid ``nobody``."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0)
    root = os.geteuid() == 0
    try:
        if root:
            _libc.setfsuid(65534)
        yield
    finally:
        if root:
            _libc.setfsuid(0)
        folder.chmod(0o755)


#: (bucket, kind, condition) -> the S3 prefix holding that run folder; (bucket, "seed", "") -> torchtitan's seed
_UPLOADED: dict[tuple[str, str, str], str] = {}


def where_for(store: str, kind: str, condition: str, request: pytest.FixtureRequest, tmp_path: Path,
              stack: contextlib.ExitStack) -> Where:
    """Build the cell's run folder (local, or uploaded to moto) and the fault its condition injects."""
    base = request.getfixturevalue("artifacts")
    local = tmp_path / "run"
    build(base, local, kind, condition)
    seed = base / "titan" / f"step-{OLDER}"
    if store == "local":
        if condition != "denied":
            return Where(str(local), {}, str(seed))
        # (request_timeout=None: each storage call on the calling thread, whose filesystem uid is dropped)
        return Where(str(local), {"request_timeout": None}, str(seed), lambda: _refused(local))
    server, bucket = request.getfixturevalue("moto_s3"), request.getfixturevalue("moto_bucket")
    prefix = _UPLOADED.get((bucket, kind, condition))
    if prefix is None:  # one upload per folder: the paths only read it (a follower's lease is hidden)
        prefix = f"s3://{bucket}/{kind}-{condition}"
        _upload(local, f"{prefix}/run", server.options())
        _UPLOADED[(bucket, kind, condition)] = prefix
    seed_url = f"s3://{bucket}/titan-seed/step-{OLDER}"  # one copy for every cell, outside each run folder
    if (bucket, "seed", "") not in _UPLOADED:
        _upload(seed, seed_url, server.options())
        _UPLOADED[(bucket, "seed", "")] = seed_url
    proxy = stack.enter_context(FaultProxy(server.endpoint_url))
    kinds = {"denied": "403", "throttled": "503", "timeout": HANG}

    def listing(method: str, path: str) -> bool:
        return method == "GET" and "list-type=2" in path

    @contextlib.contextmanager
    def fault() -> Iterator[None]:
        if condition in kinds:
            proxy.fail_always.append((listing, kinds[condition]))
        try:
            yield
        finally:
            proxy.fail_always.clear()

    return Where(f"{prefix}/run", {**server.options(), "endpoint_url": proxy.endpoint_url, **FAST,
                                   **SHORT.get(condition, {})}, seed_url, fault)


# ------------------------------------------------------------------ paths
@dataclasses.dataclass
class Seen:
    """What a path did: the step it resumed (None: a fresh start), or what it raised / reported."""

    step: int | None = None
    error: BaseException | None = None
    text: str = ""


def _run_restore(w: Where) -> Seen:
    model = plain_model(-1.0)
    mgr = bytecp.CheckpointManager(w.url, storage_options=w.options)
    with w.fault():
        step = mgr.restore({"model": model})
    if step is not None:
        assert torch.equal(model.weight, torch.full_like(model.weight, float(step))), "loaded another step's weights"
    return Seen(step, text=";".join(u for u, _ in mgr.skipped))


def _titan(w: Where, **config: Any) -> Seen:
    mgr, model, train = titan_manager(w.url, seed=1, storage_options=w.options, **config)
    with w.fault():
        resumed = mgr.load(step=config.get("load_step", -1))
    if not resumed:
        return Seen(None)
    if "initial_load_path" in config and train.step == 0:  # the initial checkpoint: step 10's model only
        assert all(torch.equal(p, torch.full_like(p, float(OLDER))) for p in model.parameters())
        return Seen(None, text="initial")
    assert all(torch.equal(p, torch.full_like(p, float(train.step))) for p in model.parameters())
    return Seen(train.step)


def _run_latest(w: Where) -> Seen:
    from bytecp.adapters.lightning import latest_checkpoint

    with w.fault():
        url = latest_checkpoint(w.url, storage_options=w.options)
    if url is None:
        return Seen(None)
    from bytecp.interop.runs import step_of

    return Seen(step_of(url.rstrip("/").rsplit("/", 1)[-1]), text=url)


def _run_lightning_last(w: Where) -> Seen:
    import pytorch_lightning as pl
    from bytecp.adapters.lightning import (
        BytecpCheckpointIO,
        BytecpModelCheckpoint,
        BytecpSingleDeviceStrategy,
    )

    module = LitModule()
    trainer = pl.Trainer(strategy=BytecpSingleDeviceStrategy(device="cpu", checkpoint_io=BytecpCheckpointIO(
        async_save=False, storage_options=w.options)), max_steps=STEPS[-1] + 1, logger=False, limit_train_batches=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=True,
        callbacks=[BytecpModelCheckpoint(dirpath=w.url, storage_options=w.options, every_n_train_steps=1000)])
    with w.fault():
        trainer.fit(module, module.loader(), ckpt_path="last")
    return Seen(module.started_at or None)


def _run_ls(w: Where, capsys: pytest.CaptureFixture[str]) -> Seen:
    from bytecp.cli import main

    capsys.readouterr()
    with w.fault():
        code = main(["ls", w.url, "--storage-options", json.dumps(w.options)])
    out = capsys.readouterr()
    if code != 0:
        return Seen(None, RuntimeError(f"exit {code}: {out.err.strip()}"), out.err)
    pick = [line for line in out.out.splitlines() if line.endswith("<- resume")]
    assert len(pick) == 1, out.out
    from bytecp.interop.runs import step_of

    return Seen(step_of(pick[0].split("\t")[0]), text=out.out)


def _run_follow(w: Where) -> Seen:
    served = plain_model(-1.0)
    with w.fault():
        gen = bytecp.follow(w.url, {"model": served}, poll_s=0.05, idle_timeout_s=0.5, storage_options=w.options)
        up = next(gen, None)
        gen.close()
    if up is None:
        return Seen(None)
    if not up.ok:
        return Seen(up.step, RuntimeError(up.error), up.error or "")
    assert torch.equal(served.weight, torch.full_like(served.weight, float(up.step)))
    return Seen(up.step)


def _observe(path: str, w: Where, capsys: pytest.CaptureFixture[str]) -> Seen:
    runners: dict[str, Callable[[], Seen]] = {
        "restore": lambda: _run_restore(w),
        "titan_load": lambda: _titan(w),
        "titan_load_step": lambda: _titan(w, load_step=NEWEST),
        "titan_initial": lambda: _titan(w, initial_load_path=w.seed, initial_load_model_only=True),
        "latest_checkpoint": lambda: _run_latest(w),
        "lightning_last": lambda: _run_lightning_last(w),
        "ls": lambda: _run_ls(w, capsys),
        "follow": lambda: _run_follow(w),
    }
    try:
        return runners[path]()
    except Exception as e:  # noqa: BLE001 - compared with the table below
        return Seen(None, e, f"{type(e).__name__}: {e}")


# ------------------------------------------------------------------ the table
def _expect(path: str, condition: str, seen: Seen) -> None:
    """Assert the cell: what ``path`` does with the folder of ``condition`` (docs/guide.md's table)."""
    spec = TABLE[condition]
    d, loads, foreign = spec["decision"], spec.get("loads", spec["decision"]), spec.get("foreign", False)
    why = f"{path} x {condition}: {seen}"
    if isinstance(d, Refused):
        if path == "titan_load_step" and d.error is ResumeDecisionError:  # an explicit step: the one asked for
            assert seen.error is None and seen.step == NEWEST, why
            return
        if path == "follow":  # a failed update, the state untouched; the follower polls on
            assert seen.error is not None and seen.text.startswith(d.error.__name__ + ": "), why
            assert not seen.text.startswith(f"{d.error.__name__}: {d.error.__name__}"), why  # one name
        elif path == "ls":  # the reason on stderr, exit 2 (cannot decide) or 3 (storage)
            want = 3 if issubclass(d.error, OSError) else 2
            assert seen.error is not None and str(seen.error).startswith(f"exit {want}:"), why
        else:
            assert isinstance(seen.error, d.error), why
        if d.match:
            import re

            assert re.search(d.match, seen.text), why
        return
    if d == "fresh":
        if path == "titan_load_step":
            assert isinstance(seen.error, FileNotFoundError) and "committed steps in" in seen.text, why
            assert "none)" in seen.text, why
        elif path == "titan_initial":
            assert seen.error is None and seen.text == "initial", why
        elif path == "ls":  # nothing to list: says so (exit 2), a resume there starts afresh
            assert seen.error is not None and "nothing at" in seen.text and "starts afresh" in seen.text, why
        else:
            assert seen.error is None and seen.step is None, why
        return
    if path == "ls" and condition == "unreadable_metadata":  # its metadata.json read: the one resume loads marked
        assert seen.error is None and seen.step == loads and "resume skips it" in seen.text, why
        return
    if path in ("latest_checkpoint", "ls"):  # they show the pick; the fallback is the loader's
        assert seen.error is None and seen.step == d, why
        return
    if path == "lightning_last" and foreign:  # the Hugging Face Trainer's folder: no Lightning trainer state
        assert isinstance(seen.error, (ConfigError, CheckpointNotFoundError)), why
        return
    if path == "titan_load_step" and loads != d:  # an explicit step: its own error, no fallback
        assert isinstance(seen.error, CorruptCheckpointError), why
        return
    if path == "follow" and (foreign or loads != d):  # a failed update of the newest; it waits for a newer one
        name = seen.text.split(":", 1)[0]
        assert seen.error is not None and seen.step == d and not seen.text.startswith(f"{name}: {name}"), why
        return
    assert seen.error is None and seen.step == loads, why
    if path == "restore" and loads != d:  # skipped, named
        assert f"step-{d}" in seen.text, why


def _cells() -> list[Any]:
    out = []
    for store in ("local", "s3"):
        for condition, spec in TABLE.items():
            if store == "local" and condition in S3_ONLY:
                continue  # a local disk neither throttles nor times out
            for path in PATHS:
                marks = [pytest.mark.s3] if store == "s3" else []
                if store == "s3" and path == "lightning_last" and not isinstance(spec["decision"], Refused):
                    marks.append(pytest.mark.xfail(strict=True, reason=(
                        "Lightning's ModelCheckpoint and its ckpt_path='last' check their dirpath and the path "
                        "resolved with Lightning's own fsspec filesystem, which has none of the S3 options; use "
                        "ckpt_path=latest_checkpoint(dirpath, storage_options=...) on object stores")))
                out.append(pytest.param(store, condition, path, marks=marks, id=f"{store}-{condition}-{path}"))
    return out


@pytest.mark.parametrize(("store", "condition", "path"), _cells())
def test_cell(store: str, condition: str, path: str, request: pytest.FixtureRequest, tmp_path: Path,
              capsys: pytest.CaptureFixture[str]) -> None:
    with contextlib.ExitStack() as stack:
        w = where_for(store, _kind(path), condition, request, tmp_path, stack)
        seen = _observe(path, w, capsys)
    _expect(path, condition, seen)


@pytest.mark.s3
@pytest.mark.ceph
@pytest.mark.parametrize("path", ["restore", "titan_load", "latest_checkpoint", "ls", "follow"])
def test_a_refusal_by_ceph_is_raised_never_a_fresh_start(path: str, request: pytest.FixtureRequest, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Ceph RGW refuses the listing (a secret it does not know: ``SignatureDoesNotMatch``):
    every path raises (the follower reports) a :class:`StoragePermissionError`."""
    server, bucket = request.getfixturevalue("ceph_rgw"), request.getfixturevalue("ceph_bucket")
    kind = _kind(path)
    prefix = _UPLOADED.get((bucket, kind, "bytecp"))
    if prefix is None:
        build(request.getfixturevalue("artifacts"), tmp_path / "run", kind, "bytecp")
        prefix = f"s3://{bucket}/{kind}-bytecp"
        _upload(tmp_path / "run", f"{prefix}/run", server.options())
        _UPLOADED[(bucket, kind, "bytecp")] = prefix
    w = Where(f"{prefix}/run", {**server.options(secret="not-the-secret"), **FAST}, f"{prefix}/seed")
    _expect(path, "denied", _observe(path, w, capsys))
