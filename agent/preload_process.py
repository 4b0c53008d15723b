"""The preload process of ``agent/preload.py``: it imports the modules it is given once, then
forks a worker for each request on its socket, and reports each child's exit status.

Run as ``python -m stalwart.agent.preload_process --fd FD MODULE...`` by
:class:`~stalwart.agent.preload.Preloader`. It imports nothing of stalwart beyond what its package
does, and nothing heavy before the modules asked for: its children are the workers, and what it
imported they have.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SETSID_TIMEOUT_S = 5.0  # how long the preload process waits for a child's new session before it answers


class PreloadError(Exception):
    """The preload process could not import its modules soundly for forking."""



@dataclass
class _Job:
    target: dict[str, Any]
    env: dict[str, str]
    cwd: str | None
    log: str


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    try:
        sock.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:
        pass  # the agent is gone: the loop sees the end of its socket


def _preload(modules: Sequence[str]) -> None:
    import importlib

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # a CUDA check must not start CUDA
    for name in modules:
        importlib.import_module(name)
    if threading.active_count() != 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        raise PreloadError(f"the imports started threads ({names}): forking would copy them half-done")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise PreloadError("the imports initialised CUDA: a forked worker could not use it")


def serve(fd: int, modules: Sequence[str]) -> _Job | None:
    """The preload process's loop. Returns in a forked child (with what it is to run), or
    ``None`` in the preload process itself when the agent is gone."""
    sock = socket.socket(fileno=fd)
    t0 = time.monotonic()
    try:
        _preload(modules)
    except BaseException as exc:  # noqa: BLE001 - reported, then the agent spawns cold
        _send(sock, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return None
    _send(sock, {"op": "ready", "seconds": round(time.monotonic() - t0, 3)})
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buf = b""
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock not in ready:
            continue
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                req = json.loads(line)
                job = _Job(req["target"], req["env"], req["cwd"], req["log"])
                pid, sync_r = _fork(sock, wake_r, wake_w)
            except (ValueError, KeyError, TypeError, OSError) as exc:  # a bad request, no memory to fork
                _send(sock, {"op": "spawned", "id": _request_id(line), "error": f"{type(exc).__name__}: {exc}"})
                continue
            if pid == 0:
                return job
            if _child_settled(sync_r):
                _send(sock, {"op": "spawned", "id": req["id"], "pid": pid})
            else:
                _kill_quietly(pid)  # it must not run the job after an error was said
                _send(sock, {"op": "spawned", "id": req["id"], "error": f"pid {pid} did not start its session"})
        _reap(sock)


def _request_id(line: bytes) -> int:
    try:
        return int(json.loads(line)["id"])
    except (ValueError, KeyError, TypeError):
        return -1


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _fork(sock: socket.socket, wake_r: int, wake_w: int) -> tuple[int, int]:
    """Fork; the child starts its own session (its process group is the worker's, as the agent
    signals it; a new session is also a new scheduler autogroup) and then says so on a pipe.
    Returns (pid, the pipe's read end) in the parent."""
    sync_r, sync_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for f in (wake_r, wake_w, sync_r):
            os.close(f)
        sock.close()
        os.setsid()
        os.write(sync_w, b"1")
        os.close(sync_w)
        return 0, -1
    os.close(sync_w)
    return pid, sync_r


def _child_settled(sync_r: int) -> bool:
    try:
        ready, _, _ = select.select([sync_r], [], [], SETSID_TIMEOUT_S)
        return bool(ready) and os.read(sync_r, 1) == b"1"
    finally:
        os.close(sync_r)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"op": "exit", "pid": pid, "status": os.waitstatus_to_exitcode(status)})


def run_job(job: _Job) -> None:
    """In the forked child: become the worker the command describes, then run its code."""
    import runpy

    fd = os.open(job.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(job.env)
    if job.cwd:
        os.chdir(job.cwd)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a fresh process's global RNG state, not the preload process's copy
    target = job.target
    if target["script"] is not None:
        script = target["script"]  # as given, relative to the working directory, as python takes it
        sys.argv = [script, *target["args"]]
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = [target["module"], *target["args"]]  # runpy sets argv[0] to the module's file
        sys.path[0] = os.getcwd()
        runpy.run_module(target["module"], run_name="__main__", alter_sys=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "--fd":
        sys.exit("usage: python -m stalwart.agent.preload_process --fd FD MODULE...")
    job = serve(int(args[1]), args[2:])
    if job is not None:
        run_job(job)


if __name__ == "__main__":
    main()
