"""A graceful agent stop (SIGTERM: systemctl stop or restart) shrinks the world but is no fault.

Real etcd, a real daemon process and real agent processes. The daemon quarantines a node at its
first fault here, so one counted fault would keep the restarted node out for good. The daemon
writes a node's fault history before the round that follows from the fault, so once the shrunk
round is there, its fault record is final.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from daemon_testlib import WAIT, DaemonProc, RoundLog, agent_process, members, new_job, stop_processes

from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.daemon.status import read_status
from stalwart.proto import records_pb2

WORKER = str(Path(__file__).resolve().parents[1] / "agent" / "worker_script.py")
STALWART = str(Path(sys.executable).with_name("stalwart"))


def _agent(etcd: LocalEtcd, job: str, node: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    return agent_process(etcd.endpoints[0], job, node, tmp_path)


def _faults(client: EtcdClient, job: str, node: str) -> records_pb2.FaultRecord:
    kv = client.get(JobKeys(job).faults(node))
    return records_pb2.FaultRecord.FromString(kv.value) if kv else records_pb2.FaultRecord()


def test_sigterm_leaves_the_world_without_a_fault(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path) -> None:
    job = new_job()
    rounds = RoundLog(etcd_client, job)
    daemon = DaemonProc(etcd_server.endpoints, job, tmp_path / "d.log", "d1", "--min-nodes", "1",
                        "--max-nodes", "2", "--join-timeout", "30", "--regrow-cooldown", "0",
                        "--quarantine-faults", "1")
    agents = {n: _agent(etcd_server, job, n, tmp_path) for n in ("n0", "n1")}
    try:
        first = rounds.wait(lambda r: members(r) == ["n0", "n1"], timeout=60)

        agents["n1"].send_signal(signal.SIGTERM)
        assert agents["n1"].wait(timeout=WAIT) == 0, (tmp_path / "n1.log").read_text()
        shrunk = rounds.wait(lambda r: r.number > first.number and members(r) == ["n0"])
        assert "left (its agent stopped)" in shrunk.reason, shrunk.reason

        record = _faults(etcd_client, job, "n1")
        assert not record.quarantined and not record.fault_times, record

        # Back after the restart (systemctl restart): registered, with no fault and no quarantine.
        agents["n1"] = _agent(etcd_server, job, "n1", tmp_path)
        deadline = time.monotonic() + WAIT
        while etcd_client.get(JobKeys(job).node("n1")) is None:
            assert time.monotonic() < deadline and agents["n1"].poll() is None, (tmp_path / "n1.log").read_text()
            time.sleep(0.05)
        row = next(r for r in read_status(etcd_client, job).nodes if r.node == "n1")
        assert "quarantined" not in row.holds and row.faults == 0, row
        assert "quarantined" not in daemon.log()
    finally:
        stop_processes(list(agents.values()))
        daemon.stop()
        rounds.close()
