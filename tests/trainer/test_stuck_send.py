"""A rank stuck in a gloo send that the abort of its world cannot interrupt exits, so that a spare
takes its rank, instead of waiting out the collective timeout.

Found in a soak: a survivor of a SIGSTOPped peer stood 30 s (its collective timeout) after the
cut of its world's connections, in "Timed out waiting 30000ms for send operation to complete".
gloo interrupts a blocked receive, or a send still waiting for its peer's receive, once the
connection is shut down, but not a send partly written to a peer that stopped reading: neither
the shutdown nor the peer's death wakes it. Real processes, a real gloo world, the trainer's real
stuck-step watch, abort and exit (``stuck_send_child.py``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from stalwart.proto.contract import EXIT_STUCK
from testkit import kill_tree

CHILD = str(Path(__file__).with_name("stuck_send_child.py"))
COLLECTIVE_TIMEOUT_S = 120.0  # the wait the exit spares the job; the test's guard is above it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_rank_stuck_in_a_send_to_a_stopped_peer_exits_for_a_spare(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, CHILD, "--port", str(port), "--timeout", str(COLLECTIVE_TIMEOUT_S)]
    peer = subprocess.Popen([*cmd, "--rank", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        stuck = subprocess.run([*cmd, "--rank", "0"], env=env, capture_output=True, text=True,
                               timeout=COLLECTIVE_TIMEOUT_S + 60)
    finally:
        kill_tree(peer.pid)
        peer.wait()
    assert "send:" not in stuck.stdout, f"the send ended by itself: {stuck.stdout}"
    assert stuck.returncode == EXIT_STUCK, stuck.stdout + stuck.stderr[-3000:]
    assert "still stuck" in stuck.stderr and "for a spare to take its rank" in stuck.stderr
