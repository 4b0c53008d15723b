"""Election: a SIGKILLed leader is replaced within TTL + 1 s and its guarded writes are refused."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from subprocess import Popen

import pytest

from stalwart.coord.client import EtcdClient
from stalwart.coord.election import Election, Leadership
from stalwart.coord.errors import NotLeader
from stalwart.coord.lease import Lease
from stalwart.coord.local import LocalEtcd
from testkit import python_child

TTL = 2

CANDIDATE = """
import sys, time
from stalwart.coord.client import EtcdClient
from stalwart.coord.config import EtcdConfig
from stalwart.coord.election import Election
from stalwart.coord.lease import Lease
client = EtcdClient(EtcdConfig(endpoints=sys.argv[1]))
lease = Lease(client, int(sys.argv[4]))
print("CAMPAIGNING", flush=True)
lead = Election(client, sys.argv[2]).campaign(lease, sys.argv[3].encode())
print(f"LEADER {sys.argv[3]} {lead.term} {lead.lease_id}", flush=True)
time.sleep(600)
"""


def _pump(name: str, child: Popen[str], lines: queue.Queue[tuple[str, str, float]]) -> None:
    assert child.stdout is not None
    for line in child.stdout:
        lines.put((name, line.strip(), time.monotonic()))


def test_leader_killed_standby_takes_over_and_old_term_is_fenced(
    etcd_server: LocalEtcd, etcd_client: EtcdClient, key_prefix: str
) -> None:
    key = key_prefix + "leader"
    lines: queue.Queue[tuple[str, str, float]] = queue.Queue()
    children = {f"c{i}": python_child(CANDIDATE, etcd_server.endpoints[0], key, f"c{i}", str(TTL))
                for i in range(3)}
    for name, child in children.items():
        threading.Thread(target=_pump, args=(name, child, lines), daemon=True).start()

    def next_leader(timeout: float) -> tuple[str, int, int, float]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                _, line, at = lines.get(timeout=left)
            except queue.Empty:
                break
            if line.startswith("LEADER "):
                _, who, term, lease_id = line.split()
                return who, int(term), int(lease_id), at
        raise AssertionError("no leader elected in time")

    try:
        first, term1, lease1, _ = next_leader(30)
        election = Election(etcd_client, key)
        assert election.leader().value == first.encode()  # type: ignore[union-attr]
        os.killpg(children[first].pid, signal.SIGKILL)
        killed = time.monotonic()
        second, term2, lease2, elected_at = next_leader(TTL + 5)
        assert second != first and term2 > term1
        assert elected_at - killed <= TTL + 1, f"took {elected_at - killed:.2f} s"
        # A write fenced by the dead leader's term is refused, the new leader's goes through.
        old = Leadership(key, term1, lease1, first.encode())
        with pytest.raises(NotLeader):
            election.guarded_put(old, key_prefix + "round", b"from the old leader")
        new = Leadership(key, term2, lease2, second.encode())
        election.guarded_put(new, key_prefix + "round", b"from the new leader")
        assert etcd_client.get(key_prefix + "round").value == b"from the new leader"  # type: ignore[union-attr]
    finally:
        for child in children.values():
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def test_deposed_leader_in_process_cannot_write(etcd_client: EtcdClient, key_prefix: str) -> None:
    key = key_prefix + "leader"
    election = Election(etcd_client, key)
    lease = Lease(etcd_client, TTL)
    lead = election.campaign(lease, b"me", timeout=5)
    election.guarded_put(lead, key_prefix + "x", b"1")
    etcd_client.revoke(lease.id)  # the lease expires under the leader's feet
    lease.stop()
    with pytest.raises(NotLeader):
        election.guarded_put(lead, key_prefix + "x", b"2")
    assert etcd_client.get(key_prefix + "x").value == b"1"  # type: ignore[union-attr]
    # A new candidate can now lead, and resign hands the key back.
    with Lease(etcd_client, TTL) as lease2:
        lead2 = election.campaign(lease2, b"other", timeout=5)
        assert lead2.term > lead.term
        assert election.resign(lead2)
        assert election.leader() is None
