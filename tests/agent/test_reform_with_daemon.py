"""In-place re-form end to end: a real daemon decides the rounds, two real agents (one worker and
one warm spare each) follow them. A worker SIGKILLed on one node: the daemon restarts the round
with the same members, the other node's worker re-forms in place and the spare takes the lost
rank. Prints the times from the SIGKILL (run with ``-s``); asserts no timing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stalwart.agent.config import AgentConfig
from stalwart.agent.node import NodeAgent
from stalwart.coord.client import EtcdClient
from stalwart.coord.local import LocalEtcd
from stalwart.proto import agent_pb2
from testkit import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
from daemon_testlib import DaemonProc, RoundLog, members, new_job  # noqa: E402

WORKER = str(Path(__file__).with_name("reform_worker.py"))


@pytest.fixture
def agents() -> Iterator[Callable[[AgentConfig], NodeAgent]]:
    started: list[tuple[NodeAgent, threading.Thread]] = []

    def start(config: AgentConfig) -> NodeAgent:
        agent = NodeAgent(config)
        agent.start()
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        started.append((agent, thread))
        return agent

    yield start
    for agent, thread in started:
        agent.shutdown()
        thread.join(timeout=15)


def _pids(agent: NodeAgent, round_number: int, min_step: int = 0) -> list[int]:
    status = agent.status()
    return [w.pid for w in status.workers if status.round == round_number and w.round == round_number
            and w.state == agent_pb2.WORKER_RUNNING and w.last_step >= min_step]


def test_daemon_round_change_reforms_in_place(etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path,
                                              agents, monkeypatch: pytest.MonkeyPatch) -> None:
    events = tmp_path / "events"
    monkeypatch.setenv("EVENTS", str(events))
    job = new_job()
    rounds = RoundLog(etcd_client, job)
    daemon = DaemonProc(etcd_server.endpoints, job, tmp_path / "d.log", "d1", "--min-nodes", "2",
                        "--max-nodes", "2", "--join-timeout", "30", "--regrow-cooldown", "0")
    try:
        nodes = {}
        for n in ("n0", "n1"):
            nodes[n] = agents(AgentConfig(
                job=job, node_id=n, command=(sys.executable, WORKER), workers=1, spares=1, insecure=True,
                etcd=etcd_server.client_config(), state_dir=str(tmp_path / n), lease_ttl=2, probe="fake",
                probe_interval=0.2, stall_floor=5.0, stall_first_step=60.0, stop_grace=2.0,
                progress_interval=0.2, peer_probe_interval=5.0))
        first = rounds.wait_number(1, timeout=60)
        assert members(first) == ["n0", "n1"]
        for n, agent in nodes.items():
            wait_for(lambda agent=agent: _pids(agent, 1, min_step=3), 60, f"{n}'s worker stepping in round 1")
            wait_for(lambda agent=agent: any(s.ready for s in agent.status().spares), 60, f"{n}'s spare ready")
        survivor = _pids(nodes["n0"], 1)[0]
        spare = next(s.pid for s in nodes["n1"].status().spares if s.ready)
        killed = time.time()
        os.kill(_pids(nodes["n1"], 1)[0], signal.SIGKILL)
        second = rounds.wait_number(2, timeout=20)
        round_seen = time.time()
        assert members(second) == ["n0", "n1"]
        wait_for(lambda: _pids(nodes["n0"], 2, min_step=1) == [survivor]
                 and _pids(nodes["n1"], 2, min_step=1) == [spare], 20, "the survivor and the spare stepping in round 2")
        stepping = time.time()
    finally:
        daemon.stop()
        rounds.close()
    lines = [line.split() for line in events.read_text().splitlines()]
    reform = next(float(f[6]) for f in lines if f[0] == "reform" and int(f[1]) == survivor and f[4] == "2")
    assigned = next(float(f[6]) for f in lines if f[0] == "assigned" and int(f[1]) == spare)
    print(f"\nwith a daemon: SIGKILL -> round 2 seen by the test {round_seen - killed:.3f} s, Reform at the "
          f"survivor {reform - killed:.3f} s, spare assigned {assigned - killed:.3f} s, both stepping in round 2 "
          f"by {stepping - killed:.3f} s (polling)")
