"""The daemon's JSON log lines carry the round and node they are about (a real daemon process)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from daemon_testlib import DaemonProc, RoundLog, members, new_job

from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.lease import Lease
from stalwart.coord.local import LocalEtcd
from stalwart.proto import records_pb2


def _register(client: EtcdClient, job: str, node: str, ip: str) -> Lease:
    """A node whose agent is reached at an IP address, as on a real cluster."""
    lease = Lease(client, 2)
    rec = records_pb2.NodeRecord(node_id=node, address=f"{ip}:7077", devices=1, hostname=node,
                                 registered_at=time.time())
    client.put(JobKeys(job).node(node), rec.SerializeToString(), lease=lease.id)
    return lease


def test_round_and_node_context_are_what_the_message_is_about(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                              tmp_path: Path) -> None:
    job = new_job()
    rounds = RoundLog(etcd_client, job)
    daemon = DaemonProc(etcd_server.endpoints, job, tmp_path / "d.log", "d1", "--min-nodes", "1",
                        "--max-nodes", "2", "--log-format", "json")
    leases = {}
    try:
        leases["a"] = _register(etcd_client, job, "a", "10.1.2.3")
        leases["b"] = _register(etcd_client, job, "b", "10.1.2.4")
        first = rounds.wait(lambda r: members(r) == ["a", "b"])
        leases["b"].revoke()
        rounds.wait(lambda r: r.number > first.number and members(r) == ["a"])
    finally:
        daemon.stop()
        rounds.close()
        for lease in leases.values():
            lease.stop()
    events = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    about_rounds = [e for e in events if re.match(r"round \d+\b", e["msg"])]
    assert about_rounds, daemon.log()
    for e in about_rounds:
        assert e["round"] == int(e["msg"].split()[1].rstrip(":")), e
    with_node = [e for e in events if "node" in e]
    assert with_node, daemon.log()
    for e in with_node:
        assert e["node"] in ("a", "b"), e  # a node id, never an address
    assert any(e.get("node") == "b" and "lease lost" in e["msg"] for e in events), daemon.log()
