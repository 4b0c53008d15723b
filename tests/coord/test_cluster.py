"""A 3-member cluster loses the member in use during a stream of writes: no call fails."""

from __future__ import annotations

import threading
from collections.abc import Callable

from stalwart.coord.client import EtcdClient
from stalwart.coord.local import LocalEtcd, free_ports

WRITES = 300


def test_member_killed_during_writes_is_invisible_to_the_caller(make_etcd: Callable[..., LocalEtcd]) -> None:
    etcd = make_etcd(3)
    client = EtcdClient(etcd.client_config(timeout=10.0))
    try:
        victim = etcd.endpoints.index(client.current_endpoint)
        killer = None
        for i in range(WRITES):
            if i == WRITES // 3:
                killer = threading.Thread(target=etcd.kill, args=(victim,))
                killer.start()
            client.put(f"/cluster/{i:04d}", str(i).encode())  # any failure here fails the test
        assert killer is not None
        killer.join()
        assert not etcd.members[victim].running
        assert client.current_endpoint != etcd.endpoints[victim]
        kvs, _ = client.get_prefix("/cluster/")
        assert [kv.value for kv in kvs] == [str(i).encode() for i in range(WRITES)]
    finally:
        client.close()


def test_a_local_cluster_gets_distinct_ports() -> None:
    """Ports picked one after another may repeat (a released port can be handed out again): a
    cluster's peer URLs once named one port twice and etcd refused to start."""
    for _ in range(20):
        ports = free_ports(64)
        assert len(set(ports)) == 64
