"""The last save of a job on a full disk: tried again until it commits (the disk freed), or,
with no retry, the worker fails and says so to its agent instead of saying it finished.

Real processes (examples/train_gpt.py), a real full file system (a 2 MiB tmpfs: needs root), and
the real gRPC Progress service on a unix socket standing in for the agent. The only save is the
last one (``--save-every`` beyond the run): it meets the full disk, and the stand-in agent frees
the disk when it hears that save failed.
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from trainer_testlib import REPO, Direct, tail

from stalwart.ckpt import list_checkpoints
from stalwart.proto import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.timeout(600)


class DiskAgent(agent_pb2_grpc.ProgressServicer):
    """Records what the worker says; frees the disk (``filler``) at its first failed save, if asked."""

    def __init__(self, filler: Path, free_on_failure: bool) -> None:
        self.messages: queue.Queue[agent_pb2.WorkerMessage] = queue.Queue()
        self.closed = threading.Event()
        self.filler, self.free_on_failure = filler, free_on_failure

    def Connect(self, request_iterator: Iterator[agent_pb2.WorkerMessage],  # noqa: N802 - gRPC's name
                context: grpc.ServicerContext) -> Iterator[agent_pb2.AgentCommand]:
        for msg in request_iterator:
            self.messages.put(msg)
            if msg.WhichOneof("kind") == "checkpoint" and not msg.checkpoint.committed and self.free_on_failure:
                self.filler.unlink(missing_ok=True)
        self.closed.set()
        return iter(())

    def said(self) -> dict[str, list[agent_pb2.WorkerMessage]]:
        kinds: dict[str, list[agent_pb2.WorkerMessage]] = {}
        while not self.messages.empty():
            msg = self.messages.get()
            kinds.setdefault(msg.WhichOneof("kind"), []).append(msg)
        return kinds


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A 2 MiB tmpfs filled to the last byte: (the file system, the file that fills it)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    filler = disk / "filler.bin"
    try:
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        yield disk, filler
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _run(ds_env: dict[str, str], tmp_path: Path, disk: Path, agent: DiskAgent, *extra: str) -> int:
    sock = tmp_path / "agent.sock"
    server = grpc.server(futures.ThreadPoolExecutor(4))
    agent_pb2_grpc.add_ProgressServicer_to_server(agent, server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    jobs = Direct({**ds_env, "STALWART_AGENT_SOCKET": str(sock)})
    try:
        log = tmp_path / "run.log"
        rc = jobs.run(1, str(REPO / "examples" / "train_gpt.py"), "--ckpt-dir", str(disk / "ckpt"), "--steps", "4",
                      "--save-every", "1000", *extra, log=log)
        assert agent.closed.wait(30), tail(log)
        print(tail(log))
        return rc
    finally:
        jobs.close()
        server.stop(0)


def test_a_last_save_on_a_full_disk_is_tried_again_and_commits_once_the_disk_is_freed(
        ds_env: dict[str, str], tmp_path: Path, full_disk: tuple[Path, Path]) -> None:
    disk, filler = full_disk
    agent = DiskAgent(filler, free_on_failure=True)
    assert _run(ds_env, tmp_path, disk, agent) == 0
    said = agent.said()
    assert [(m.checkpoint.step, m.checkpoint.committed) for m in said["checkpoint"]] == [(4, False), (4, True)]
    assert said["goodbye"][0].goodbye.reason == "finished"
    assert [c.step for c in list_checkpoints(str(disk / "ckpt")) if c.committed] == [4]


def test_without_retries_a_last_save_that_fails_fails_the_worker_and_it_does_not_say_it_finished(
        ds_env: dict[str, str], tmp_path: Path, full_disk: tuple[Path, Path]) -> None:
    disk, filler = full_disk
    agent = DiskAgent(filler, free_on_failure=False)
    assert _run(ds_env, tmp_path, disk, agent, "--final-save-retry", "0") != 0
    said = agent.said()
    assert [(m.checkpoint.step, m.checkpoint.committed) for m in said["checkpoint"]] == [(4, False)]
    assert said["goodbye"][0].goodbye.reason == "failed"
