"""Leases: a crashed holder's keys go within TTL + 1 s; a live holder keeps them."""

from __future__ import annotations

import os
import signal
import time

import pytest

from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import LeaseLost
from stalwart.coord.lease import Lease
from stalwart.coord.local import LocalEtcd
from stalwart.coord.watch import EventType, Watch, wait_for
from testkit import python_child

TTL = 2

HOLDER = """
import sys, time
from stalwart.coord.client import EtcdClient
from stalwart.coord.config import EtcdConfig
from stalwart.coord.lease import Lease
client = EtcdClient(EtcdConfig(endpoints=sys.argv[1]))
lease = Lease(client, int(sys.argv[3]))
client.put(sys.argv[2], b"held", lease=lease.id)
print("READY", flush=True)
time.sleep(600)
"""


def test_sigkilled_holder_loses_its_key_within_ttl_plus_one(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                            key_prefix: str) -> None:
    key = key_prefix + "node"
    child = python_child(HOLDER, etcd_server.endpoints[0], key, str(TTL))
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY", child.stderr.read() if child.stderr else ""
        kv = etcd_client.get(key)
        assert kv is not None and kv.lease != 0
        with Watch(etcd_client, key, kv.mod_revision + 1) as watch:
            assert watch.wait_ready(5)
            os.killpg(child.pid, signal.SIGKILL)
            killed = time.monotonic()
            ev = wait_for(watch, lambda e: e.type is EventType.DELETE and e.key == key, TTL + 3)
            gone_after = time.monotonic() - killed
        assert ev is not None, "key was never deleted"
        assert gone_after <= TTL + 1, f"key deleted {gone_after:.2f} s after SIGKILL (TTL {TTL} s)"
    finally:
        child.kill()
        child.wait()


def test_live_holder_keeps_its_key_for_three_ttls(etcd_client: EtcdClient, key_prefix: str) -> None:
    key = key_prefix + "node"
    with Lease(etcd_client, TTL) as lease:
        etcd_client.put(key, b"v", lease=lease.id)
        end = time.monotonic() + 3 * TTL
        while time.monotonic() < end:
            assert etcd_client.get(key) is not None
            assert lease.alive
            time.sleep(0.2)
    assert etcd_client.get(key) is None  # revoked on exit


def test_lost_lease_is_signalled(etcd_client: EtcdClient, key_prefix: str) -> None:
    reasons: list[str] = []
    lease = Lease(etcd_client, TTL, on_lost=reasons.append)
    try:
        etcd_client.revoke(lease.id)  # as if etcd expired it
        assert lease.lost.wait(TTL + 1)
        deadline = time.monotonic() + 2
        while not reasons and time.monotonic() < deadline:  # callbacks run right after the event is set
            time.sleep(0.01)
        assert reasons and not lease.alive
        with pytest.raises(LeaseLost):
            etcd_client.keepalive_once(lease.id)
    finally:
        lease.stop()
