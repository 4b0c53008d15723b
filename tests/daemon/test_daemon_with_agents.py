"""The daemon with real agents and real workers: the restart path and a dead agent, end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
from daemon_testlib import DaemonProc, RoundLog, agent_process, members, new_job, stop_processes

from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.proto import agent_pb2, agent_pb2_grpc, records_pb2
from stalwart.proto.contract import ENV_ORPHAN_TIMEOUT
from testkit import wait_for

WORKER = str(Path(__file__).resolve().parents[1] / "agent" / "worker_script.py")
STALWART = str(Path(sys.executable).with_name("stalwart"))

RPC = (grpc.RpcError,)  # an agent or daemon not answering yet: try again


def _start_agent(etcd: LocalEtcd, job: str, node: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    return agent_process(etcd.endpoints[0], job, node, tmp_path)


def _status(client: EtcdClient, job: str, node: str) -> agent_pb2.NodeStatus:
    record = records_pb2.NodeRecord.FromString(client.get(JobKeys(job).node(node)).value)  # type: ignore[union-attr]
    with grpc.insecure_channel(record.address) as channel:
        return agent_pb2_grpc.AgentStub(channel).GetStatus(agent_pb2.StatusRequest(), timeout=5)


def _running(client: EtcdClient, job: str, node: str, round_number: int) -> list[int]:
    status = _status(client, job, node)
    if status.round != round_number:
        return []
    return [w.pid for w in status.workers if w.state == agent_pb2.WORKER_RUNNING]


def _progress(client: EtcdClient, job: str, node: str) -> int:
    """The round of the node's newest progress record that reports a step (0: none)."""
    kv = client.get(JobKeys(job).progress(node))
    record = records_pb2.ProgressRecord.FromString(kv.value) if kv else None
    return record.round if record is not None and record.step > 0 else 0


def test_worker_death_restarts_the_round_and_a_dead_agent_shrinks_it(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path) -> None:
    job = new_job()
    rounds = RoundLog(etcd_client, job)
    daemon = DaemonProc(etcd_server.endpoints, job, tmp_path / "d.log", "d1", "--min-nodes", "2",
                        "--max-nodes", "3", "--join-timeout", "30", "--regrow-cooldown", "0",
                        "--agent-restart-grace", "3")
    agents = {n: agent_process(etcd_server.endpoints[0], job, n, tmp_path, extra="progress_interval = 0.2",
                               env={ENV_ORPHAN_TIMEOUT: "3"}) for n in ("n0", "n1", "n2")}
    try:
        first = rounds.wait_number(1, timeout=60)
        assert members(first) == ["n0", "n1", "n2"]
        for n in agents:
            wait_for(lambda n=n: _running(etcd_client, job, n, 1), 60, f"{n}'s worker in round 1", tmp_path,
                     retry_on=RPC)

        # a worker dies: the agent reports it, the daemon restarts the round with the same members
        victim = _running(etcd_client, job, "n1", 1)[0]
        os.kill(victim, signal.SIGKILL)
        second = rounds.wait_number(2, timeout=15)
        assert members(second) == ["n0", "n1", "n2"] and "worker failed" in second.reason
        for n in agents:
            wait_for(lambda n=n: _running(etcd_client, job, n, 2), 60, f"{n}'s worker in round 2", tmp_path,
                     retry_on=RPC)

        # an agent dies and no successor comes: its worker trains on while the daemon waits for one
        # (the host answers: only the agent is gone); after the grace the world shrinks without
        # it, and the orphaned worker stops itself
        worker = psutil.Process(_running(etcd_client, job, "n2", 2)[0])
        wait_for(lambda: _progress(etcd_client, job, "n0") == 2, 30, "round 2 training")
        agents["n2"].send_signal(signal.SIGKILL)
        third = rounds.wait_number(3, timeout=30)
        assert members(third) == ["n0", "n1"]
        assert "no agent came back within 3s" in third.reason, third.reason
        assert worker.wait(timeout=30) is not None or not worker.is_running()
    finally:
        stop_processes(list(agents.values()))
        daemon.stop()
        rounds.close()
