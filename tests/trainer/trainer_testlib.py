"""Helpers for trainer tests (importable as ``trainer_testlib``; conftest puts this folder on the path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def tail(log: Path, lines: int = 40) -> str:
    if not log.exists():
        return "(no log)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
