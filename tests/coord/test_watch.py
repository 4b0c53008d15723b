"""Prefix watches: exactly-once delivery across an etcd restart; compaction is a clear error."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import CompactedError
from stalwart.coord.local import LocalEtcd
from stalwart.coord.watch import EventType, Watch, WatchEvent

WRITES = 1000


def test_watch_survives_restart_in_the_middle_of_a_stream(make_etcd: Callable[..., LocalEtcd]) -> None:
    etcd = make_etcd(1)
    prefix = "/stream/"
    writer_client = EtcdClient(etcd.client_config(timeout=30.0))
    watch_client = EtcdClient(etcd.client_config())
    errors: list[BaseException] = []

    def write_all() -> None:
        try:
            for i in range(WRITES):
                # create-if-absent: a write retried across the restart cannot appear twice.
                writer_client.create(f"{prefix}{i:04d}", str(i).encode())
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    events: list[WatchEvent] = []
    watch = Watch(watch_client, prefix, start_revision=0)
    try:
        assert watch.wait_ready(5)
        writer = threading.Thread(target=write_all)
        writer.start()
        restarted = False
        deadline = time.monotonic() + 90
        while len(events) < WRITES and time.monotonic() < deadline:
            events.extend(watch.get(timeout=1.0))
            if not restarted and len(events) >= WRITES // 3:
                etcd.kill(0)  # SIGKILL mid-stream, then start again on the same data
                time.sleep(0.3)
                etcd.restart(0)
                restarted = True
        writer.join(timeout=60)
        events.extend(watch.get(timeout=1.0))  # anything duplicated would arrive now
        assert restarted
        assert not errors, errors
        assert watch.reconnects >= 1
    finally:
        watch.close()
        writer_client.close()
        watch_client.close()

    assert [e.key for e in events] == [f"{prefix}{i:04d}" for i in range(WRITES)]
    assert all(e.type is EventType.PUT for e in events)
    revisions = [e.mod_revision for e in events]
    assert revisions == sorted(set(revisions))


def test_watch_from_a_compacted_revision_raises(make_etcd: Callable[..., LocalEtcd], key_prefix: str) -> None:
    # A private etcd: compaction is cluster-wide and would break other tests' watches.
    etcd_client = EtcdClient(make_etcd(1).client_config())
    first = etcd_client.put(key_prefix + "a", b"1")
    last = etcd_client.put(key_prefix + "a", b"2")
    etcd_client.put(key_prefix + "a", b"3")
    etcd_client.compact(last)
    with Watch(etcd_client, key_prefix, start_revision=first) as watch:
        with pytest.raises(CompactedError) as info:
            watch.get(timeout=5)
    assert info.value.compact_revision >= last
    etcd_client.close()


def test_watch_sees_deletes_and_lease_expiry(etcd_client: EtcdClient, key_prefix: str) -> None:
    with Watch(etcd_client, key_prefix) as watch:
        assert watch.wait_ready(5)
        etcd_client.put(key_prefix + "a", b"1")
        etcd_client.delete(key_prefix + "a")
        lease = etcd_client.grant(2)
        etcd_client.put(key_prefix + "b", b"2", lease=lease)
        etcd_client.revoke(lease)
        seen: list[tuple[EventType, str]] = []
        deadline = time.monotonic() + 5
        while len(seen) < 4 and time.monotonic() < deadline:
            seen += [(e.type, e.key) for e in watch.get(timeout=1)]
    assert seen == [(EventType.PUT, key_prefix + "a"), (EventType.DELETE, key_prefix + "a"),
                    (EventType.PUT, key_prefix + "b"), (EventType.DELETE, key_prefix + "b")]


def test_iterating_a_watch_ends_when_it_is_closed(etcd_client: EtcdClient, key_prefix: str) -> None:
    watch = Watch(etcd_client, key_prefix)
    assert watch.wait_ready(5)
    etcd_client.put(key_prefix + "a", b"1")
    seen: list[str] = []

    def consume() -> None:
        for ev in watch:
            seen.append(ev.key)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.02)
    watch.close()
    t.join(timeout=3)
    assert not t.is_alive() and seen == [key_prefix + "a"]
