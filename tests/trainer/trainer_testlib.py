"""Helpers for trainer tests (importable as ``trainer_testlib``; conftest puts this folder on the path)."""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc

from stalwart.agent.preload import ForkedProcess, Preloader, parse_command
from stalwart.chaos.scenario import ClusterSpec
from stalwart.proto import agent_pb2, agent_pb2_grpc
from testkit import kill_tree

REPO = Path(__file__).resolve().parents[2]
# What a DeepSpeed rank imports before its script runs: the chaos cluster's preload list.
PRELOAD = ClusterSpec().preload


class Zygote:
    """Ranks forked from one preload process that imported torch and DeepSpeed once, as an agent
    with ``preload`` starts its workers (``stalwart.agent.preload``): on a small machine each cold
    rank spends seconds of CPU importing, most of a short test's time. A rank is started cold
    when the preload process is not ready, or for an environment it was not started with (what
    it imported may have read that)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        target = parse_command([sys.executable, "-m", "json.tool"])  # each start names its own
        assert target is not None
        self.env = dict(env)
        self._preloader = Preloader(target, PRELOAD, log, self.env, str(REPO))
        self._preloader.start()

    def start(self, argv: list[str], env: dict[str, str], log: Path,
              cwd: Path = REPO) -> subprocess.Popen[bytes] | ForkedProcess:
        """``argv`` (``sys.executable`` and a script) as a process in a session of its own, its
        output appended to ``log``: forked when it can be, else started cold."""
        target = parse_command(argv)
        if target is not None and self._same_imports(env) and self._preloader.wait_ready(120):
            proc = self._preloader.spawn(env, log, str(cwd), target=target)
            if proc is not None:
                return proc
        return _start_cold(argv, env, log, cwd)

    def _same_imports(self, env: dict[str, str]) -> bool:
        keys = ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "PYTHONPATH")
        return all(env.get(k) == self.env.get(k) for k in keys)

    def close(self) -> None:
        self._preloader.close()


_zygote: Zygote | None = None


def use_zygote(zygote: Zygote | None) -> None:
    """Set by the session fixture: every harness here starts its ranks through it."""
    global _zygote
    _zygote = zygote


def start_rank(argv: list[str], env: dict[str, str], log: Path,
               cwd: Path = REPO) -> subprocess.Popen[bytes] | ForkedProcess:
    """Start one rank (its own session, output appended to ``log``): forked from the session's
    preload process when there is one (:class:`Zygote`)."""
    if _zygote is not None:
        return _zygote.start(argv, env, log, cwd)
    return _start_cold(argv, env, log, cwd)


def _start_cold(argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)


class Torchrun:
    """Starts single-node torchrun jobs (``--standalone``, no restarts) and kills leftovers at teardown."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, nproc: int, script: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--max-restarts", "0", "--monitor-interval", "0.1", script, *args]
        out = open(log, "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=REPO,
                                start_new_session=True)
        out.close()
        self.procs.append(proc)
        return proc

    def run(self, nproc: int, script: str, *args: str, log: Path, timeout: float = 600) -> int:
        proc = self.start(nproc, script, *args, log=log)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            raise AssertionError(f"torchrun did not finish; log tail:\n{tail(log)}") from None

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()


class Direct:
    """Starts the ranks of a one-node world as plain processes with the environment torchrun would
    give them (no launcher process: one interpreter that imports torch fewer per job). For tests
    whose ranks all exit on their own; when one fails the others are killed, as torchrun does."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def run(self, nproc: int, script: str, *args: str, log: Path, timeout: float = 600) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(nproc):
            world = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                     "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port)}
            procs.append(start_rank([sys.executable, script, *args], {**self.env, **world}, log))
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in procs]
                failed = [c for c in codes if c not in (None, 0)]
                if failed:
                    return failed[0]
                if all(c == 0 for c in codes):
                    return 0
                if time.monotonic() > deadline:
                    raise AssertionError(f"the ranks did not finish; log tail:\n{tail(log)}")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    kill_tree(p.pid)
                    p.wait()

    def close(self) -> None:
        """Nothing to do: ``run`` leaves no process behind."""


def tail(log: Path, lines: int = 40) -> str:
    if not log.exists():
        return "(no log)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


class ProgressAgent(agent_pb2_grpc.ProgressServicer):
    """The agent's real gRPC Progress service, standing in for the agent: it records what a
    worker says and, with ``on_message``, acts on each message (a test's agent side)."""

    def __init__(self, on_message: Callable[[agent_pb2.WorkerMessage], None] | None = None) -> None:
        self.messages: queue.Queue[agent_pb2.WorkerMessage] = queue.Queue()
        self.closed = threading.Event()
        self._on_message = on_message

    def Connect(self, request_iterator: Iterator[agent_pb2.WorkerMessage],  # noqa: N802 - gRPC's name
                context: grpc.ServicerContext) -> Iterator[agent_pb2.AgentCommand]:
        for msg in request_iterator:
            self.messages.put(msg)
            if self._on_message is not None:
                self._on_message(msg)
        self.closed.set()
        return iter(())

    def said(self) -> dict[str, list[agent_pb2.WorkerMessage]]:
        """What was said so far, by kind of message."""
        kinds: dict[str, list[agent_pb2.WorkerMessage]] = {}
        while not self.messages.empty():
            msg = self.messages.get()
            kinds.setdefault(msg.WhichOneof("kind") or "", []).append(msg)
        return kinds

    @contextmanager
    def serving(self, sock: Path) -> Iterator[Path]:
        """Serve on the unix socket ``sock`` (what ``STALWART_AGENT_SOCKET`` names) while inside."""
        server = grpc.server(futures.ThreadPoolExecutor(4))
        agent_pb2_grpc.add_ProgressServicer_to_server(self, server)
        server.add_insecure_port(f"unix:{sock}")
        server.start()
        try:
            yield sock
        finally:
            server.stop(0)
