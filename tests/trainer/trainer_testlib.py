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

from stalwart.proto import agent_pb2, agent_pb2_grpc
from testkit import kill_tree

REPO = Path(__file__).resolve().parents[2]


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
        with open(log, "ab") as out:
            for rank in range(nproc):
                world = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                         "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": str(port)}
                procs.append(subprocess.Popen([sys.executable, script, *args], stdout=out, stderr=subprocess.STDOUT,
                                              env={**self.env, **world}, cwd=REPO, start_new_session=True))
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
