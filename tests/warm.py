"""Warm interpreters: fresh processes without paying for ``import torch``.

Starting ``python`` and importing torch and bytecp costs 3-15 s on this
2-core machine (the upper figure when other jobs run), and many tests start
a fresh process per case: a rank to SIGKILL mid-save, a job to restart, a
CLI to exit with a code. A *warm interpreter* is one server process per
test session that imported those modules once; every :meth:`Warm.popen`
forks a child of it that runs the command as ``python`` would (``-m
MODULE``, ``-c CODE`` or ``SCRIPT``, with the given argv, environment,
working directory and standard streams) and returns a handle shaped like
:class:`subprocess.Popen` (``pid``, ``poll``, ``wait``, ``communicate``,
``kill``, ``send_signal``, ``returncode``; ``stdout``/``stderr`` pipes).

A child is a real process: it can be killed, stopped, continued and
signalled by pid, it runs gloo and writes files. What differs from
``subprocess``: the child leaves through ``threading``'s and ``atexit``'s
exit hooks and then ``os._exit`` -- not through the interpreter's full
finalization. Tests of what happens *at interpreter exit*
(tests/core/test_exit.py) keep starting real interpreters.

Used through the ``warm`` fixture of tests/conftest.py (session scope).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["Warm", "WarmProcess", "DEFAULT_PRELOAD"]

#: what every warm interpreter imports before it forks. torch._dynamo is what the
#: first optimizer a process builds imports (1.5-3 s of CPU here, about 900 modules),
#: torch._inductor.compile_fx what the first ``torch.compile`` call imports (1.5 s;
#: Megatron-Core's and DeepSpeed's modules call it when imported): imported once, not
#: in every fork that trains a step; bytecp.api is what the first save or load imports (``import bytecp``
#: alone is lazy)
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "numpy", "pyarrow",
                   "bytecp", "bytecp.dist", "bytecp.api")

_HEADER = 8  # length prefix of a request


def _send_msg(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    payload = len(data).to_bytes(_HEADER, "big") + data
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, fds: list[int] | None = None) -> bytes:
    buf = b""
    while len(buf) < n:
        if fds is not None and not buf:
            chunk, got, _flags, _addr = socket.recv_fds(sock, n - len(buf), 8)
            fds.extend(got)
        else:
            chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return buf


def _recv_msg(sock: socket.socket, fds: list[int] | None = None) -> Any:
    n = int.from_bytes(_recv_exact(sock, _HEADER, fds), "big")
    return json.loads(_recv_exact(sock, n))


# ---------------------------------------------------------------------- the server (its own process)
def _run_child(req: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the requested command, never return."""
    code: int = 1
    try:
        if req.get("new_session"):
            os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # what subprocess's close_fds does
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        # what a fresh interpreter takes from its environment at start-up
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        if req["env"].get("PYTHONWARNINGS"):
            import warnings

            warnings._processoptions(req["env"]["PYTHONWARNINGS"].split(","))  # type: ignore[attr-defined]
        argv = req["argv"]
        import runpy

        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in argv[0]
            sys.path[0:1] = [req["cwd"], *extra]
            code = _exit_code(lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0:1] = ["", *extra]
            code = _exit_code(lambda: exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"}))
        else:
            sys.argv = list(argv)
            sys.path[0:1] = [str(Path(argv[0]).resolve().parent), *extra]
            code = _exit_code(lambda: runpy.run_path(argv[0], run_name="__main__"))
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
        except BaseException:
            pass
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def _exit_code(run: Any) -> int:
    try:
        run()
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    return 0


def _serve(path: str, preload: list[str]) -> None:
    """The server's main loop: one connection per child, status sent back when it ends."""
    import importlib

    for mod in preload:
        importlib.import_module(mod)
    import atexit
    import gc

    gc.freeze()  # the imports' objects: no child's collection walks them again
    atexit.register(gc.unfreeze)  # frozen at the end: never freed, and triton reports them as leaks
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    print("ready", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ, None)
    children: dict[int, socket.socket] = {}  # pidfd -> connection
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the test session died without closing us
            return
        for key, _ in sel.select(5.0):
            if key.data is None:
                conn, _ = srv.accept()
                fds: list[int] = []
                try:
                    req = _recv_msg(conn, fds)
                except (EOFError, OSError, ValueError):
                    conn.close()
                    continue
                if req.get("stop"):
                    return
                pid = os.fork()
                if pid == 0:
                    srv.close()
                    _run_child(req, fds)
                for fd in fds:
                    os.close(fd)
                _send_msg(conn, {"pid": pid})
                pidfd = os.pidfd_open(pid)
                children[pidfd] = conn
                sel.register(pidfd, selectors.EVENT_READ, pid)
            else:
                pidfd, pid = key.fd, key.data
                _, status = os.waitpid(pid, 0)
                sel.unregister(pidfd)
                os.close(pidfd)
                conn = children.pop(pidfd)
                try:
                    _send_msg(conn, {"status": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()


# ---------------------------------------------------------------------- the client (the test process)
class WarmProcess:
    """A child of a warm interpreter, used as a :class:`subprocess.Popen`."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], stdout: IO[Any] | None,
                 stderr: IO[Any] | None, text: bool) -> None:
        self._conn = conn
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.stderr = stderr
        self.stdin = None
        self._text = text
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            import select

            if select.select([self._conn], [], [], 0)[0]:
                self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        self.returncode = int(_recv_msg(self._conn)["status"])
        self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._read_status()
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            finally:
                if self.returncode is None:
                    self._conn.settimeout(None)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Read both pipes to their end, then wait; raises TimeoutExpired as Popen does."""
        if input is not None:
            raise ValueError("warm children take no input")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not hasattr(self, "_chunks"):
            self._chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        sel = selectors.DefaultSelector()
        for name in ("stdout", "stderr"):
            f = getattr(self, name)
            if f is not None and not f.closed:
                sel.register(f.fileno(), selectors.EVENT_READ, name)
        while sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for key, _ in sel.select(left):
                data = os.read(key.fd, 65536)
                if data:
                    self._chunks[key.data].append(data)
                else:
                    sel.unregister(key.fd)
                    getattr(self, key.data).close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = [b"".join(self._chunks[n]) if getattr(self, n) is not None else None for n in ("stdout", "stderr")]
        if self._text:
            return tuple(o.decode(errors="replace") if o is not None else None for o in out)  # type: ignore[return-value]
        return out[0], out[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


class Warm:
    """One warm interpreter (a server process that imported ``preload``)."""

    def __init__(self, preload: Iterable[str] = DEFAULT_PRELOAD, *, start_timeout: float = 300) -> None:
        self.preload = list(preload)
        self._dir = tempfile.mkdtemp(prefix="bytecp-warm-")
        self.path = os.path.join(self._dir, "sock")
        code = f"import sys; sys.path[0:0] = [{str(Path(__file__).resolve().parent)!r}]; " \
               f"import warm; warm._serve({self.path!r}, {self.preload!r})"
        self._server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self._server.stdout.readline()), daemon=True)
        reader.start()
        reader.join(start_timeout)
        if not ready or ready[0].strip() != "ready":
            self._server.kill()
            raise RuntimeError(f"the warm interpreter did not start within {start_timeout} s "
                               f"(preloading {self.preload}; exit code {self._server.poll()})")

    @property
    def alive(self) -> bool:
        return self._server.poll() is None

    def popen(self, args: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, stdin: Any = None, stdout: Any = None,
              stderr: Any = None, text: bool = False, start_new_session: bool = False) -> WarmProcess:
        """As ``subprocess.Popen(args, ...)``; ``args[0]`` must be ``sys.executable``."""
        argv = [os.fspath(a) for a in args]
        if argv[0] != sys.executable:
            raise ValueError(f"a warm child runs Python, not {argv[0]!r}")
        if stdin not in (None, subprocess.DEVNULL):
            raise ValueError("warm children read no stdin")
        fds, keep = [], []  # fds sent, ours to close once sent
        devnull = os.open(os.devnull, os.O_RDWR)
        keep.append(devnull)
        fds.append(devnull)
        pipes: dict[str, IO[Any]] = {}
        for name, spec in (("stdout", stdout), ("stderr", stderr)):
            if spec is None:
                fds.append(name == "stdout" and 1 or 2)
            elif spec == subprocess.DEVNULL:
                fds.append(devnull)
            elif spec == subprocess.PIPE:
                r, w = os.pipe()
                pipes[name] = os.fdopen(r, "rb")
                fds.append(w)
                keep.append(w)
            elif spec == subprocess.STDOUT and name == "stderr":
                fds.append(fds[1])
            elif isinstance(spec, int):
                fds.append(spec)
            else:
                fds.append(spec.fileno())
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            _send_msg(conn, {"argv": argv[1:], "env": dict(os.environ if env is None else env),
                             "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                             "new_session": start_new_session}, fds)
            pid = int(_recv_msg(conn)["pid"])
        except BaseException:
            conn.close()
            for f in pipes.values():
                f.close()
            raise
        finally:
            for fd in keep:
                os.close(fd)
        return WarmProcess(conn, pid, argv, pipes.get("stdout"), pipes.get("stderr"), text)

    def run(self, args: Sequence[str | os.PathLike[str]], *, timeout: float | None = None,
            capture_output: bool = False, text: bool = False, check: bool = False,
            **kw: Any) -> subprocess.CompletedProcess[Any]:
        """As ``subprocess.run``; on a timeout the child is killed and TimeoutExpired raised."""
        if capture_output:
            kw["stdout"] = kw["stderr"] = subprocess.PIPE
        p = self.popen(args, text=text, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        done = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def close(self) -> None:
        if self._server.poll() is None:
            try:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(self.path)
                _send_msg(conn, {"stop": True})
                conn.close()
                self._server.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self._server.kill()
                self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass
