"""A short self-check of the coordination layer against a real local etcd cluster.

Brings up a 3-member etcd on loopback, registers simulated nodes under leases, elects a
leader, then injects the faults the coordination layer must absorb — a node that stops
refreshing its lease, an etcd member SIGKILLed under load, the leader crashing — and records
what was seen and how long each took. Used by ``stalwart demo`` until the chaos runner exists.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stalwart.coord.client import EtcdClient
from stalwart.coord.election import Election
from stalwart.coord.keys import JobKeys
from stalwart.coord.lease import Lease
from stalwart.coord.local import LocalEtcd
from stalwart.coord.watch import EventType, Watch, wait_for

log = logging.getLogger(__name__)


@dataclass
class Check:
    name: str
    passed: bool
    seconds: float
    detail: str


@dataclass
class SelfCheckReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def table(self) -> str:
        width = max(len(c.name) for c in self.checks)
        rows = [f"{'check':<{width}}  result  seconds  detail"]
        for c in self.checks:
            rows.append(f"{c.name:<{width}}  {'ok' if c.passed else 'FAILED':<6}  {c.seconds:7.2f}  {c.detail}")
        return "\n".join(rows)


def run_selfcheck(nodes: int = 3, ttl: int = 2, progress: Callable[[str], None] = print) -> SelfCheckReport:
    report = SelfCheckReport()
    keys = JobKeys("selfcheck")

    def record(name: str, passed: bool, started: float, detail: str) -> None:
        report.checks.append(Check(name, passed, time.monotonic() - started, detail))
        progress(f"[{'ok' if passed else 'FAILED'}] {name}: {detail}")

    with tempfile.TemporaryDirectory(prefix="stalwart-selfcheck-") as tmp, LocalEtcd(tmp, 3) as etcd:
        progress(f"etcd cluster up: {', '.join(etcd.endpoints)}")
        client = EtcdClient(etcd.client_config(timeout=10.0))
        leases: list[Lease] = []
        try:
            t = time.monotonic()
            for i in range(nodes):
                lease = Lease(client, ttl)
                leases.append(lease)
                client.put(keys.node(f"node{i}"), f"node{i}".encode(), lease=lease.id)
            listed, revision = client.get_prefix(keys.nodes_prefix)
            record("register nodes", len(listed) == nodes, t, f"{len(listed)}/{nodes} nodes under leases of {ttl} s")

            t = time.monotonic()
            leader_lease = Lease(client, ttl)
            election = Election(client, keys.leader)
            lead = election.campaign(leader_lease, b"daemon-a", timeout=5)
            record("elect leader", True, t, f"daemon-a leads, term {lead.term}")

            with Watch(client, keys.nodes_prefix, revision + 1) as watch:
                watch.wait_ready(5)
                t = time.monotonic()
                leases[-1].stop()  # the node goes silent, as if its host lost power
                lost = wait_for(watch, lambda e: e.type is EventType.DELETE, ttl + 3)
                record("silent node detected", lost is not None, t,
                       f"{lost.key.rsplit('/', 1)[-1] if lost else 'nothing'} removed by lease expiry")

            t = time.monotonic()
            victim = etcd.endpoints.index(client.current_endpoint)
            failed = 0
            for i in range(200):
                if i == 50:
                    etcd.kill(victim)
                try:
                    client.put(keys.progress("node0"), str(i).encode())
                except Exception:  # counted: the check fails if any write fails
                    failed += 1
            record("etcd member killed under load", failed == 0, t,
                   f"member {etcd.endpoints[victim]} SIGKILLed; 200 writes, {failed} failed")

            t = time.monotonic()
            leader_lease.stop()  # the leader crashes
            standby_lease = Lease(client, ttl)
            lead2 = Election(client, keys.leader).campaign(standby_lease, b"daemon-b", timeout=ttl + 5)
            refused = False
            try:
                election.guarded_put(lead, keys.round, b"stale decision")
            except Exception:
                refused = True
            record("leader crash and fencing", refused and lead2.term > lead.term, t,
                   f"daemon-b leads (term {lead2.term}); old leader's write {'refused' if refused else 'ACCEPTED'}")
            for lease in [*leases[:-1], standby_lease]:
                lease.revoke()
        finally:
            client.close()
    return report
