"""The last save of a job on a full disk: tried again until it commits (the disk freed), or,
with no retry, the worker fails and says so to its agent instead of saying it finished.

Real processes (examples/train_gpt.py), a real full file system (a 2 MiB tmpfs: needs root), and
the real gRPC Progress service on a unix socket standing in for the agent. The only save is the
last one (``--save-every`` beyond the run): it meets the full disk, and the stand-in agent frees
the disk when it hears that save failed.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainer_testlib import REPO, Direct, ProgressAgent, tail

from stalwart.ckpt import list_checkpoints
from stalwart.proto import agent_pb2

pytestmark = pytest.mark.timeout(600)


def disk_agent(filler: Path, free_on_failure: bool) -> ProgressAgent:
    """A stand-in agent that frees the disk (``filler``) at the worker's first failed save, if asked."""

    def act(msg: agent_pb2.WorkerMessage) -> None:
        if msg.WhichOneof("kind") == "checkpoint" and not msg.checkpoint.committed and free_on_failure:
            filler.unlink(missing_ok=True)

    return ProgressAgent(act)


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


def _run(ds_env: dict[str, str], tmp_path: Path, disk: Path, agent: ProgressAgent, *extra: str) -> int:
    with agent.serving(tmp_path / "agent.sock") as sock:
        jobs = Direct({**ds_env, "STALWART_AGENT_SOCKET": str(sock)})
        try:
            log = tmp_path / "run.log"
            rc = jobs.run(1, str(REPO / "examples" / "train_gpt.py"), "--ckpt-dir", str(disk / "ckpt"), "--steps",
                          "4", "--save-every", "1000", *extra, log=log)
            assert agent.closed.wait(30), tail(log)
            print(tail(log))
            return rc
        finally:
            jobs.close()


def test_a_last_save_on_a_full_disk_is_tried_again_and_commits_once_the_disk_is_freed(
        ds_env: dict[str, str], tmp_path: Path, full_disk: tuple[Path, Path]) -> None:
    disk, filler = full_disk
    agent = disk_agent(filler, free_on_failure=True)
    assert _run(ds_env, tmp_path, disk, agent) == 0
    said = agent.said()
    assert [(m.checkpoint.step, m.checkpoint.committed) for m in said["checkpoint"]] == [(4, False), (4, True)]
    assert said["goodbye"][0].goodbye.reason == "finished"
    assert [c.step for c in list_checkpoints(str(disk / "ckpt")) if c.committed] == [4]


def test_without_retries_a_last_save_that_fails_fails_the_worker_and_it_does_not_say_it_finished(
        ds_env: dict[str, str], tmp_path: Path, full_disk: tuple[Path, Path]) -> None:
    disk, filler = full_disk
    agent = disk_agent(filler, free_on_failure=False)
    assert _run(ds_env, tmp_path, disk, agent, "--final-save-retry", "0") != 0
    said = agent.said()
    assert [(m.checkpoint.step, m.checkpoint.committed) for m in said["checkpoint"]] == [(4, False)]
    assert said["goodbye"][0].goodbye.reason == "failed"
