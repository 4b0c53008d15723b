"""The rendezvous backend and store on their own, against torch's documented contract."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from stalwart.agent.torchrun_backend import EtcdRendezvousBackend, EtcdStore
from stalwart.coord.client import EtcdClient
from stalwart.coord.config import EtcdConfig
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd, free_port
from testkit import python_child

SETTER = """
import sys
from stalwart.agent.torchrun_backend import EtcdRendezvousBackend
from stalwart.coord.client import EtcdClient
from stalwart.coord.config import EtcdConfig
from stalwart.coord.keys import JobKeys
backend = EtcdRendezvousBackend(EtcdClient(EtcdConfig(endpoints=sys.argv[1], timeout=30)), JobKeys(sys.argv[2]))
me, rounds = sys.argv[3], int(sys.argv[4])
wins = 0
for _ in range(rounds):
    state, token = backend.get_state()
    n = int(state.split(b":")[0])
    new_state, new_token, ok = backend.set_state(f"{n + 1}:{me}".encode(), token)
    assert new_token >= token
    if ok:
        assert new_state == f"{n + 1}:{me}".encode()
        wins += 1
print("WINS", wins, flush=True)
"""


def test_first_set_creates_then_token_fences(etcd_client: EtcdClient, key_prefix: str) -> None:
    job = key_prefix.strip("/").replace("/", "-")
    backend = EtcdRendezvousBackend(etcd_client, JobKeys(job))
    assert backend.get_state() is None
    state, token, ok = backend.set_state(b"a")  # type: ignore[misc]
    assert ok and state == b"a"
    lost = backend.set_state(b"b")  # no token: only when no state exists
    assert lost is not None and lost[2] is False and lost[0] == b"a"
    state, token2, ok = backend.set_state(b"c", token)  # type: ignore[misc]
    assert ok and state == b"c" and token2 != token
    stale = backend.set_state(b"d", token)  # the old token is no longer current
    assert stale is not None and stale[:3] == (b"c", token2, False)
    bogus = backend.set_state(b"e", "not-a-token")
    assert bogus is not None and bogus[2] is False and bogus[0] == b"c"


def test_concurrent_compare_and_set_from_processes(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                    key_prefix: str) -> None:
    job = key_prefix.strip("/").replace("/", "-")
    EtcdRendezvousBackend(etcd_client, JobKeys(job)).set_state(b"0:init")
    procs = [python_child(SETTER, etcd_server.endpoints[0], job, f"p{i}", "40") for i in range(4)]
    wins = 0
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            wins += int(out.split()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    state, _ = EtcdRendezvousBackend(etcd_client, JobKeys(job)).get_state()  # type: ignore[misc]
    # Every successful set moved the counter by exactly one: no lost or doubled update.
    assert int(state.split(b":")[0]) == wins > 0


def test_state_survives_a_member_failure(make_etcd: Callable[..., LocalEtcd]) -> None:
    etcd = make_etcd(3)
    client = EtcdClient(etcd.client_config(timeout=10.0))
    try:
        backend = EtcdRendezvousBackend(client, JobKeys("survive"))
        _, token, _ = backend.set_state(b"round-1")  # type: ignore[misc]
        etcd.kill(etcd.endpoints.index(client.current_endpoint))
        assert backend.get_state() == (b"round-1", token)
        result = backend.set_state(b"round-2", token)
        assert result is not None and result[2] and result[0] == b"round-2"
    finally:
        client.close()


def test_unreachable_etcd_is_a_rendezvous_connection_error() -> None:
    client = EtcdClient(EtcdConfig(endpoints=(f"127.0.0.1:{free_port()}",), timeout=1.0))
    with pytest.raises(RendezvousConnectionError):
        EtcdRendezvousBackend(client, JobKeys("x")).get_state()
    client.close()


def test_store_semantics(etcd_client: EtcdClient, key_prefix: str) -> None:
    store = EtcdStore(etcd_client, key_prefix, timeout=timedelta(seconds=5))
    prefixed = dist.PrefixStore("round.1", store)
    prefixed.set("MASTER_ADDR", "127.0.0.1")
    assert prefixed.get("MASTER_ADDR") == b"127.0.0.1"
    assert prefixed.multi_get(["MASTER_ADDR"]) == [b"127.0.0.1"]
    assert prefixed.check(["MASTER_ADDR"]) and not prefixed.check(["nope"])
    assert store.compare_set("cs", "", "v1") == b"v1"
    assert store.compare_set("cs", "wrong", "v2") == b"v1"
    assert store.compare_set("cs", "v1", "v2") == b"v2"
    assert store.delete_key("cs") and not store.delete_key("cs")

    # add from several threads: every increment counted once
    def bump() -> None:
        for _ in range(20):
            store.add("counter", 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("counter", 0) == 80

    # get blocks until another writer sets the key
    threading.Timer(0.3, lambda: store.set("late", b"here")).start()
    assert store.get("late") == b"here"
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=0.5))


def _handler(etcd_server: LocalEtcd, job: str, node: str):  # type: ignore[no-untyped-def]
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from stalwart.agent.torchrun_backend import create_rendezvous_handler

    params = RendezvousParameters(backend="stalwart", endpoint=etcd_server.endpoints[0], run_id=job,
                                  min_nodes=1, max_nodes=1, node_id=node, join_timeout=10)
    return create_rendezvous_handler(params)


@pytest.mark.parametrize("verdict", ["fatal", "cordoned", "operator-hold", "quarantined"])
def test_unhealthy_or_cordoned_node_does_not_join(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                  key_prefix: str, verdict: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousError

    from stalwart.proto import records_pb2

    job = key_prefix.strip("/").replace("/", "-").replace("[", "-").replace("]", "")
    keys = JobKeys(job)
    if verdict == "fatal":
        record = records_pb2.HealthRecord(node_id="sick", state=records_pb2.HEALTH_FATAL, findings=[
            records_pb2.Finding(source="nvml", device=3, state=records_pb2.HEALTH_FATAL, code="xid-79")])
        etcd_client.put(keys.health("sick"), record.SerializeToString())
    elif verdict == "cordoned":
        etcd_client.put(keys.node("sick"), records_pb2.NodeRecord(node_id="sick", cordoned=True).SerializeToString())
    elif verdict == "operator-hold":
        hold = records_pb2.CordonRecord(node_id="sick", reason="bad fan")
        etcd_client.put(keys.cordon("sick"), hold.SerializeToString())
    else:
        etcd_client.put(keys.faults("sick"),
                        records_pb2.FaultRecord(node_id="sick", quarantined=True).SerializeToString())
    handler = _handler(etcd_server, job, "sick")
    try:
        with caplog.at_level("ERROR"), pytest.raises(RendezvousError):
            handler.next_rendezvous()
        assert any("sick" in r.getMessage() and "does not join" in r.getMessage() for r in caplog.records)
        assert etcd_client.get(keys.torchrun_state) is None  # it never touched the rendezvous
    finally:
        handler.shutdown()


def test_healthy_node_joins_and_gets_a_fresh_master_per_round(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                              key_prefix: str) -> None:
    job = key_prefix.strip("/").replace("/", "-")
    handler = _handler(etcd_server, job, "well")
    try:
        first = handler.next_rendezvous()
        assert (first.rank, first.world_size) == (0, 1)
        assert handler.use_agent_store is False
        second = handler.next_rendezvous()
        assert second.bootstrap_store_info.master_port != 0
        # each round publishes its own master address and port under its own store prefix
        kvs, _ = etcd_client.get_prefix(JobKeys(job).torchrun_store_prefix)
        published = {kv.key.rsplit("/", 2)[-2] for kv in kvs if kv.key.endswith("/MASTER_PORT")}
        assert len(published) == 2, [kv.key for kv in kvs]
    finally:
        handler.shutdown()


def test_rdzv_conf_options_reach_the_etcd_client(etcd_server: LocalEtcd, tls_dir, make_etcd,  # type: ignore[no-untyped-def]
                                                 server_tls) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from stalwart.agent.torchrun_backend import create_rendezvous_handler, etcd_config_from_params

    params = RendezvousParameters(backend="stalwart", endpoint="h1:2379,h2:2379", run_id="j", min_nodes=1,
                                  max_nodes=2, ca_file=str(tls_dir / "ca.crt"), cert_file=str(tls_dir / "client.crt"),
                                  key_file=str(tls_dir / "client.key"), user="u", password="p", etcd_timeout="3")
    config = etcd_config_from_params(params)
    assert config.endpoints == ("h1:2379", "h2:2379") and config.timeout == 3.0
    assert (config.ca_file, config.user) == (str(tls_dir / "ca.crt"), "u")
    # and a real mutual-TLS etcd is reachable with them
    etcd = make_etcd(1, tls=server_tls)
    tls_params = RendezvousParameters(backend="stalwart", endpoint=etcd.endpoints[0], run_id="tls", min_nodes=1,
                                      max_nodes=1, ca_file=str(tls_dir / "ca.crt"),
                                      cert_file=str(tls_dir / "client.crt"), key_file=str(tls_dir / "client.key"))
    handler = create_rendezvous_handler(tls_params)
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        handler.shutdown()
