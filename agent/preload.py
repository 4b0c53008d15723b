"""Workers forked from a process that imported the heavy modules once (a preload process).

Why: every worker and warm spare of a node imports torch and DeepSpeed on its own, seconds each,
all of them at once at start-up (on a small node they share its cores) and again for every
replacement. With ``AgentConfig.preload`` the agent starts one preload process as it starts: it
imports those modules while the cluster comes up, then forks each worker, which runs the
command's script or module as ``python script.py args`` would have, with its own environment,
session, working directory and log. A worker is then as far as a fork from its first line of
user code.

The preload process forks from its only Python thread and never starts a GPU (CUDA is not
initialised: a child could not use it); a module that starts a Python thread or CUDA at import
fails the preload, and the agent spawns cold, as without it. (A fork copies only the calling
thread: torch's one native helper thread, started at import, is not copied and holds no lock a
child needs.) It reports each child's exit status, so a forked worker's
exit is classified like a spawned one's. When it is gone (the agent restarts, it crashes) its
children live on, reparented: they are watched through a pidfd, their status unknown, as adopted
workers are (:class:`~stalwart.agent.adopt.AdoptedProcess`).

A forked worker's ``/proc/<pid>/environ`` and ``cmdline`` are the preload process's (a fork
does not exec): the node's environment with ``STALWART_NODE`` and ``STALWART_SOCKET``, without
the rank's variables, which only the worker's ``os.environ`` holds; ``ps`` shows ``python -m
stalwart.agent.preload_process``. Environment variables a module reads when it is imported come from the
preload process too, so the agent gives it the workers' environment less their rank.

Only a command of the form ``python [options] script.py args`` or ``python [options] -m module
args`` can be forked (:func:`parse_command`); any other is spawned as it is.

The preload process itself is ``agent/preload_process.py``. It imports at ``nice`` when the
agent may give its children the workers' priority back: an agent restarted beside training
workers must not slow their steps with seconds of imports.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stalwart.agent.preload_process import SETSID_TIMEOUT_S
from stalwart.agent.priority import set_autogroup_nice

log = logging.getLogger(__name__)

# Interpreter options that take no argument, and those that take one (``-X dev``, ``-W error``).
_FLAGS = {"-u", "-B", "-O", "-OO", "-s", "-E", "-b", "-bb", "-q", "-R"}
_FLAGS_WITH_ARG = {"-X", "-W"}


@dataclass(frozen=True)
class Target:
    """What a worker command runs, taken apart so that a fork of the preload process can run it."""

    interpreter: str
    flags: tuple[str, ...]
    script: str | None  # ``python script.py``
    module: str | None  # ``python -m module``
    args: tuple[str, ...]


def parse_command(command: Sequence[str]) -> Target | None:
    """``command`` as a :class:`Target`, or ``None`` when it is not ``python [options] script``
    or ``python [options] -m module`` (``-c``, a shell, a wrapper: those are spawned as they are)."""
    if not command or not Path(command[0]).name.startswith("python"):
        return None
    flags: list[str] = []
    i = 1
    while i < len(command):
        arg = command[i]
        if arg in _FLAGS:
            flags.append(arg)
            i += 1
        elif arg in _FLAGS_WITH_ARG and i + 1 < len(command):
            flags += [arg, command[i + 1]]
            i += 2
        elif arg == "-m" and i + 1 < len(command):
            return Target(command[0], tuple(flags), None, command[i + 1], tuple(command[i + 2:]))
        elif arg.startswith("-"):
            return None  # -c, or an option this parser does not know
        else:
            return Target(command[0], tuple(flags), arg, None, tuple(command[i + 1:]))
    return None


class ForkedProcess:
    """A worker forked by the preload process: the part of ``subprocess.Popen`` that a
    :class:`~stalwart.agent.workers.Worker` uses (``pid``, ``wait``, ``poll``, ``returncode``).
    ``wait`` returns ``None`` for a status that is unknown (the preload process went first)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._fd: int | None = None
        try:
            self._fd = os.pidfd_open(pid)  # now, while the pid surely is this child
        except (ProcessLookupError, OSError):
            self._fd = None

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def _exited(self, status: int | None) -> None:
        self.returncode = status
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._ended.set()

    def _orphaned(self) -> None:
        """The preload process is gone: wait on the pidfd, the status unknown."""
        fd = self._fd
        if fd is None:
            self._exited(None)
            return

        def watch() -> None:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll()
            self._exited(None)

        threading.Thread(target=watch, daemon=True, name=f"forked-wait {self.pid}").start()


class Preloader:
    """The agent's side of one preload process for one worker command."""

    def __init__(self, target: Target, modules: Sequence[str], log_path: Path, env: Mapping[str, str],
                 cwd: str | None = None) -> None:
        self.target = target
        self.nice = 0  # > 0 (lower_priority): it imports at this nice value; each child starts at 0 again
        self.modules = tuple(modules)
        self.log_path = log_path
        self._env = dict(env)
        self._cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # one spawn request at a time
        self._ready = threading.Event()
        self._gone = threading.Event()
        self._lost_children = False  # the preload process is gone: children are watched by pidfd
        self._replies: dict[int, dict[str, Any]] = {}
        self._reply = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before the spawn's caller took the pid
        self._abandoned: set[int] = set()  # requests whose answer came too late: their children are killed
        self._next_id = 0
        self.answer_timeout = SETSID_TIMEOUT_S + 5.0  # seconds a spawn waits for the fork's answer
        self.ready_after: float | None = None  # seconds from start to ready
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._gone.is_set()

    def start(self) -> None:
        """Start the preload process; it imports in the background (:meth:`wait_ready`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [self.target.interpreter, *self.target.flags, "-m", "stalwart.agent.preload_process",
                "--fd", str(theirs.fileno()), *self.modules]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(argv, env=self._env, cwd=self._cwd, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),),
                                          start_new_session=True)
        theirs.close()
        self._sock = ours
        self._started = time.monotonic()
        threading.Thread(target=self._read, daemon=True, name="preload-reader").start()
        log.info("preload process (pid %d) importing %s, log %s", self._proc.pid, ", ".join(self.modules),
                 self.log_path)

    def lower_priority(self, nice: int) -> None:
        """Import at ``nice`` (its process group and its session's autogroup), as a spare warms;
        the workers' priority comes back once it is ready, before it forks any. Only where the
        caller may raise a priority again (``agent/priority.py``)."""
        if self._proc is None or nice <= 0 or self._ready.is_set():
            return
        self._set_nice(nice)

    def _set_nice(self, nice: int) -> None:
        assert self._proc is not None
        try:
            os.setpriority(os.PRIO_PGRP, self._proc.pid, nice)  # its own session: the group is its pid
            set_autogroup_nice(self._proc.pid, nice)
            self.nice = nice
        except OSError as exc:
            log.warning("cannot set the priority of the preload process to %d: %s", nice, exc)

    def wait_ready(self, timeout: float) -> bool:
        """Whether the preload process is ready to fork within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._ready.is_set() and not self._gone.is_set():
            if not self._ready.wait(min(0.05, max(0.0, deadline - time.monotonic()))) \
                    and time.monotonic() >= deadline:
                break
        return self.ready

    def spawn(self, env: Mapping[str, str], log_path: Path, cwd: str | None,
              target: Target | None = None) -> ForkedProcess | None:
        """Fork a worker with this environment, log and working directory; ``None`` when the
        preload process is not ready or is gone (the caller then spawns the command cold).
        ``target``: another script or module of the same interpreter than the one it was
        started for (what it imported serves any of them)."""
        if not self.ready or self._sock is None:
            return None
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            request = {"op": "spawn", "id": rid, "target": asdict(target or self.target), "env": dict(env), "cwd": cwd,
                       "log": str(log_path)}
            try:
                log_path.touch()  # the caller may rename it at once, as a spawned process's open log
                self._sock.sendall(json.dumps(request).encode() + b"\n")
            except OSError as exc:
                log.warning("preload process unreachable (%s): spawning cold", exc)
                return None
            with self._reply:
                if not self._reply.wait_for(lambda: rid in self._replies or self._gone.is_set(),
                                            self.answer_timeout):
                    # A late child would be a second copy of this rank: it is killed when its
                    # answer comes, and a preload process this slow is used no more.
                    self._abandoned.add(rid)
                    self._gone.set()
                    log.warning("preload process did not answer a spawn in time: spawning cold from now on")
                    return None
                reply = self._replies.pop(rid, None)
                if reply is None:
                    return None
                if "error" in reply:
                    log.warning("preload process could not fork a worker (%s): spawning cold", reply["error"])
                    return None
                proc = ForkedProcess(int(reply["pid"]))
                if proc.pid in self._early:
                    proc._exited(self._early.pop(proc.pid))
                elif self._lost_children:
                    proc._orphaned()  # the preload process went after it forked: no report will come
                else:
                    self._children[proc.pid] = proc
                return proc

    def close(self) -> None:
        """Stop the preload process (its children live on)."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._sock is not None:
            self._sock.close()

    def _read(self) -> None:
        assert self._sock is not None
        buf = b""
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._handle(json.loads(line))
        except (OSError, ValueError) as exc:
            log.warning("preload process: %s", exc)
        finally:
            self._lost()

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "ready":
            if self.nice > 0:
                self._set_nice(0)  # its children are workers
            self.ready_after = time.monotonic() - self._started
            log.info("preload process ready after %.2f s (imports %.2f s)", self.ready_after, msg["seconds"])
            self._ready.set()
        elif op == "failed":
            self.error = str(msg.get("error"))
            log.warning("preload process failed: %s; workers are spawned cold", self.error)
        elif op == "spawned":
            rid, pid = int(msg["id"]), msg.get("pid")
            with self._reply:
                if pid is not None:
                    self._early.pop(int(pid), None)  # an exit of an earlier process with this pid
                late = rid in self._abandoned
                if not late:
                    self._replies[rid] = msg
                    self._reply.notify_all()
            if late and pid is not None:
                log.warning("preload process forked pid %d too late: killing it", pid)
                try:
                    os.killpg(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        elif op == "exit":
            pid, status = int(msg["pid"]), int(msg["status"])
            with self._reply:
                child = self._children.pop(pid, None)
                if child is None:
                    self._early[pid] = status
            if child is not None:
                child._exited(status)

    def _lost(self) -> None:
        with self._reply:
            self._gone.set()
            self._lost_children = True
            self._reply.notify_all()
            orphans, self._children = list(self._children.values()), {}
        if orphans:
            log.warning("preload process gone: %d forked worker(s) watched without their exit status", len(orphans))
        for child in orphans:
            child._orphaned()
