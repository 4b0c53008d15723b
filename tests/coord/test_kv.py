"""Reads, writes and transactions against a real etcd."""

from __future__ import annotations

from stalwart.coord.client import EtcdClient
from stalwart.coord.txn import Delete, Get, Put, absent, mod_revision_is, value_is


def test_put_get_delete_prefix(etcd_client: EtcdClient, key_prefix: str) -> None:
    rev1 = etcd_client.put(key_prefix + "a", b"1")
    rev2 = etcd_client.put(key_prefix + "b", b"2")
    assert rev2 > rev1
    kv = etcd_client.get(key_prefix + "a")
    assert kv is not None and kv.value == b"1" and kv.mod_revision == rev1
    kvs, revision = etcd_client.get_prefix(key_prefix)
    assert [x.key for x in kvs] == [key_prefix + "a", key_prefix + "b"]
    assert revision >= rev2
    assert etcd_client.delete(key_prefix, prefix=True) == 2
    assert etcd_client.get(key_prefix + "a") is None


def test_create_if_absent(etcd_client: EtcdClient, key_prefix: str) -> None:
    key = key_prefix + "k"
    assert etcd_client.create(key, b"first")
    assert not etcd_client.create(key, b"second")
    assert etcd_client.get(key).value == b"first"  # type: ignore[union-attr]


def test_compare_and_swap_on_mod_revision(etcd_client: EtcdClient, key_prefix: str) -> None:
    key = key_prefix + "k"
    assert etcd_client.compare_and_swap(key, b"v1", 0)
    kv = etcd_client.get(key)
    assert kv is not None
    assert etcd_client.compare_and_swap(key, b"v2", kv.mod_revision)
    assert not etcd_client.compare_and_swap(key, b"v3", kv.mod_revision)  # stale token
    assert etcd_client.get(key).value == b"v2"  # type: ignore[union-attr]


def test_txn_branches_and_gets(etcd_client: EtcdClient, key_prefix: str) -> None:
    a, b = key_prefix + "a", key_prefix + "b"
    res = etcd_client.txn([absent(a)], [Put(a, b"x"), Put(b, b"y"), Get(key_prefix, prefix=True)])
    assert res.succeeded and [kv.key for kv in res.gets[0]] == [a, b]
    kv = etcd_client.get(a)
    res = etcd_client.txn([mod_revision_is(a, kv.mod_revision), value_is(b, b"nope")],  # type: ignore[union-attr]
                          [Delete(a)], [Get(b)])
    assert not res.succeeded and res.gets[0][0].value == b"y"
    assert etcd_client.get(a) is not None


def test_lease_bound_key_goes_with_revoke(etcd_client: EtcdClient, key_prefix: str) -> None:
    lease = etcd_client.grant(5)
    etcd_client.put(key_prefix + "k", b"v", lease=lease)
    assert etcd_client.time_to_live(lease) > 0
    etcd_client.revoke(lease)
    assert etcd_client.get(key_prefix + "k") is None
    assert etcd_client.time_to_live(lease) == -1
    etcd_client.revoke(lease)  # revoking twice is not an error
