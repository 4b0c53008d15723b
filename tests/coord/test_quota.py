"""etcd's space quota: a full database refuses writes with a clear error and keeps every commit
written before; compact, defragment and disarm bring writes back. Batched puts and keep-alives."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import EtcdQuotaExceeded
from stalwart.coord.local import LocalEtcd


def test_a_full_database_refuses_writes_clearly_and_loses_no_commit(make_etcd: Callable[..., LocalEtcd]) -> None:
    etcd = make_etcd(1, extra_args=("--quota-backend-bytes", str(1 << 20)))  # 1 MiB
    with EtcdClient(etcd.client_config(timeout=10.0)) as client:
        committed = [client.put(f"/q/ckpt/{i:04d}", b"commit %d" % i) for i in range(5)]
        blob = b"x" * 64_000
        with pytest.raises(EtcdQuotaExceeded):
            for i in range(200):  # ~12 MB of history: far past the quota
                client.put("/q/filler", blob + bytes([i]))
        assert [k for _, k in client.alarms()] == ["NOSPACE"]
        with pytest.raises(EtcdQuotaExceeded):
            client.put("/q/ckpt/0005", b"commit 5")
        kvs, revision = client.get_prefix("/q/ckpt/")
        assert [kv.value for kv in kvs] == [b"commit %d" % i for i in range(5)]  # nothing lost
        assert [kv.mod_revision for kv in kvs] == committed

        client.delete("/q/filler")
        client.compact(revision)
        client.defragment()
        client.disarm_nospace()
        assert client.alarms() == []
        client.put("/q/ckpt/0005", b"commit 5")  # writes work again
        assert client.get("/q/ckpt/0005") is not None


def test_put_many_and_keepalive_many(make_etcd: Callable[..., LocalEtcd]) -> None:
    # Its own etcd: it compacts the history, which would end the watches of tests sharing one.
    with EtcdClient(make_etcd(1).client_config(timeout=10.0)) as etcd_client:
        _put_many_and_keepalive_many(etcd_client, "/pm")


def _put_many_and_keepalive_many(etcd_client: EtcdClient, key_prefix: str) -> None:
    leases = [etcd_client.grant(30) for _ in range(3)]
    items = [(f"{key_prefix}/n{i:03d}", b"v%d" % i, leases[i % 3]) for i in range(250)]  # three transactions
    etcd_client.put_many(items)
    kvs, _ = etcd_client.get_prefix(key_prefix + "/")
    assert [(kv.key, kv.value, kv.lease) for kv in kvs] == items
    ttls = etcd_client.keepalive_many(leases)
    assert set(ttls) == set(leases) and all(0 < t <= 30 for t in ttls.values())
    etcd_client.revoke(leases[0])
    assert etcd_client.keepalive_many(leases)[leases[0]] == 0
    assert etcd_client.db_size() > 0
    etcd_client.compact(etcd_client.status()["revision"])  # type: ignore[arg-type]
    etcd_client.compact(1)  # below what is compacted already: not an error
