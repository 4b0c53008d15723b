"""The node agent against a real etcd, with real worker processes, signals and gRPC."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
import pytest

from stalwart.agent.config import AgentConfig, TLSConfig
from stalwart.agent.node import NodeAgent
from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.proto import agent_pb2, agent_pb2_grpc, records_pb2
from testkit import wait_for

WORKER = str(Path(__file__).with_name("worker_script.py"))


def _config(etcd: LocalEtcd, tmp_path: Path, job: str, **kw: object) -> AgentConfig:
    settings: dict[str, object] = dict(
        job=job, node_id="n0", command=(sys.executable, WORKER), workers=2, insecure=True,
        etcd=etcd.client_config(), state_dir=str(tmp_path / "state"), lease_ttl=2, probe="fake",
        probe_interval=0.2, fault_injection=True, stall_floor=1.0, stall_factor=3.0, stall_first_step=30.0,
        stop_grace=2.0, progress_interval=0.5, peer_probe_interval=0.5)
    settings.update(kw)
    return AgentConfig(**settings)  # type: ignore[arg-type]


def _open_round(client: EtcdClient, keys: JobKeys, number: int, members: list[tuple[str, str]]) -> None:
    record = records_pb2.RoundRecord(number=number, world_size=2 * len(members), master_addr="127.0.0.1",
                                     master_port=29500)
    for i, (node, address) in enumerate(members):
        record.members.add(node_id=node, node_rank=i, first_rank=2 * i, local_world_size=2, address=address)
    client.put(keys.round, record.SerializeToString())


def _health(client: EtcdClient, keys: JobKeys, node: str = "n0") -> records_pb2.HealthRecord | None:
    kv = client.get(keys.health(node))
    return records_pb2.HealthRecord.FromString(kv.value) if kv else None


def _stub(agent: NodeAgent) -> agent_pb2_grpc.AgentStub:
    return agent_pb2_grpc.AgentStub(grpc.insecure_channel(f"127.0.0.1:{agent.port}"))


def _running_steps(agent: NodeAgent) -> list[int]:
    return [w.last_step for w in agent.status().workers if w.state == agent_pb2.WORKER_RUNNING]


def test_registration_round_workers_and_worker_death(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                     tmp_path: Path, start_agent, key_prefix: str) -> None:
    job = "agent-" + key_prefix.strip("/").split("/")[-1][-40:].replace("[", "-").replace("]", "")
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job))
    node = etcd_client.get(keys.node("n0"))
    assert node is not None and node.lease != 0
    assert records_pb2.NodeRecord.FromString(node.value).address.endswith(f":{agent.port}")
    _open_round(etcd_client, keys, 1, [("n0", agent.address)])
    wait_for(lambda: len(_running_steps(agent)) == 2 and min(_running_steps(agent)) > 2, 30, "two workers stepping")
    socket_mode = (Path(agent.config.socket_path).stat().st_mode & 0o777)
    assert socket_mode == 0o600

    victim = agent.status().workers[1].pid
    import os
    import signal
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: any(f.code == "worker-signal" for f in (_health(etcd_client, keys) or
                                                             records_pb2.HealthRecord()).findings),
             5, "the worker failure in the health record")
    status = agent.status()
    assert [w.state for w in status.workers].count(agent_pb2.WORKER_FAILED) == 1

    # a new round without this node stops its workers
    _open_round(etcd_client, keys, 2, [("other", "127.0.0.1:1")])
    wait_for(lambda: agent.status().round == 2 and not agent.status().workers, 10, "workers stopped")


def test_hung_worker_is_a_stall_and_a_slow_one_is_not(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                      tmp_path: Path, start_agent) -> None:
    job = f"stall-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job))
    _open_round(etcd_client, keys, 1, [("n0", agent.address)])
    wait_for(lambda: len(_running_steps(agent)) == 2 and min(_running_steps(agent)) > 5, 30, "workers stepping")
    # learned timeout: max(floor 1 s, 3 × 0.1 s) = 1 s; SIGSTOP rank 0 through fault injection
    stopped = time.monotonic()
    reply = _stub(agent).InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_HANG_WORKER, device=0), timeout=5)
    assert reply.applied
    wait_for(lambda: any(f.code == "stall"
                         for f in (_health(etcd_client, keys) or records_pb2.HealthRecord()).findings),
             5, "a stall in the health record")
    assert time.monotonic() - stopped <= 1.0 + 1.0 + 0.5  # timeout + 1 s, plus the injection call
    stalls = [f for f in _health(etcd_client, keys).findings if f.code == "stall"]  # type: ignore[union-attr]
    assert [f.device for f in stalls] == [0]  # rank 1 kept moving: not reported


def test_fake_gpu_faults_and_injection_rules(etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path,
                                             start_agent) -> None:
    job = f"gpu-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job))
    stub = _stub(agent)
    stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_GPU_XID, device=1, code=94), timeout=5)
    wait_for(lambda: (_health(etcd_client, keys) or records_pb2.HealthRecord()).state == records_pb2.HEALTH_TRANSIENT,
             2, "a transient verdict")
    injected = time.monotonic()
    stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_GPU_XID, device=0, code=79), timeout=5)
    wait_for(lambda: (_health(etcd_client, keys) or records_pb2.HealthRecord()).state == records_pb2.HEALTH_FATAL,
             2, "a fatal verdict")
    assert time.monotonic() - injected < 2
    assert stub.GetStatus(agent_pb2.StatusRequest(), timeout=5).health.state == records_pb2.HEALTH_FATAL
    stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_CLEAR), timeout=5)
    wait_for(lambda: (_health(etcd_client, keys) or records_pb2.HealthRecord()).state == records_pb2.HEALTH_OK,
             2, "health back to ok")


def test_fault_injection_refused_when_disabled(etcd_server: LocalEtcd, tmp_path: Path, start_agent) -> None:
    agent = start_agent(_config(etcd_server, tmp_path, f"nofault-{time.monotonic_ns()}", fault_injection=False))
    with pytest.raises(grpc.RpcError) as info:
        _stub(agent).InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_GPU_XID, code=79), timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]


def test_mutual_tls_refuses_a_client_without_the_right_certificate(etcd_server: LocalEtcd, tmp_path: Path,
                                                                   start_agent, tls_dir: Path) -> None:
    tls = TLSConfig(cert_file=str(tls_dir / "server.crt"), key_file=str(tls_dir / "server.key"),
                    ca_file=str(tls_dir / "ca.crt"))
    agent = start_agent(_config(etcd_server, tmp_path, f"tls-{time.monotonic_ns()}", insecure=False, tls=tls,
                                listen="127.0.0.1:0"))
    target = f"127.0.0.1:{agent.port}"
    ca = (tls_dir / "ca.crt").read_bytes()
    good = grpc.ssl_channel_credentials(ca, (tls_dir / "client.key").read_bytes(),
                                        (tls_dir / "client.crt").read_bytes())
    reply = agent_pb2_grpc.AgentStub(grpc.secure_channel(target, good)).Ping(agent_pb2.PingRequest(), timeout=5)
    assert reply.node_id == "n0"
    for creds in (grpc.ssl_channel_credentials(ca),  # no client certificate
                  grpc.ssl_channel_credentials((tls_dir / "other-ca.crt").read_bytes())):  # wrong CA
        with pytest.raises(grpc.RpcError) as info:
            agent_pb2_grpc.AgentStub(grpc.secure_channel(target, creds)).Ping(agent_pb2.PingRequest(), timeout=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError):
        agent_pb2_grpc.AgentStub(grpc.insecure_channel(target)).Ping(agent_pb2.PingRequest(), timeout=3)


def test_metrics_and_grpc_health(etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path,
                                 start_agent) -> None:
    import urllib.request

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    job = f"metrics-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job, metrics_port=0))
    channel = grpc.insecure_channel(f"127.0.0.1:{agent.port}")
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="stalwart.v1.Agent"),
                                                      timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    _open_round(etcd_client, keys, 1, [("n0", agent.address)])
    wait_for(lambda: len(_running_steps(agent)) == 2 and min(_running_steps(agent)) > 3, 30, "workers stepping")
    _stub(agent).InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_GPU_XID, device=0, code=79), timeout=5)
    wait_for(lambda: (_health(etcd_client, keys) or records_pb2.HealthRecord()).state == records_pb2.HEALTH_FATAL,
             2, "a fatal verdict")
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5).read().decode()
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples['stalwart_agent_steps_total{node="n0",rank="0"}'] > 3
    assert samples['stalwart_agent_round{node="n0"}'] == 1
    assert samples['stalwart_agent_health_findings{code="xid-79",node="n0",severity="HEALTH_FATAL"}'] == 1
    assert samples['stalwart_agent_faults_total{kind="injected-xid-79",node="n0"}'] == 1
    # the workers' start to their first step, counted once for the node (its first rank)
    assert samples['stalwart_badput_seconds_total{cause="startup",node="n0"}'] > 0
    assert samples['stalwart_badput_seconds_total{cause="re-form",node="n0"}'] == 0


def test_nvml_probe_without_a_gpu() -> None:
    from stalwart.agent.health import FakeProbe, make_probe

    with pytest.raises(RuntimeError):
        make_probe("nvml", 2)
    assert isinstance(make_probe("auto", 2), FakeProbe)


def test_peer_probes_name_the_unreachable_member(etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path,
                                                 start_agent) -> None:
    from stalwart.coord.local import free_port

    job = f"peers-{time.monotonic_ns()}"
    keys = JobKeys(job)
    a = start_agent(_config(etcd_server, tmp_path / "a", job))
    b = start_agent(_config(etcd_server, tmp_path / "b", job, node_id="n1"))
    _open_round(etcd_client, keys, 1, [("n0", a.address), ("n1", b.address), ("ghost", f"127.0.0.1:{free_port()}")])
    for node in ("n0", "n1"):
        wait_for(lambda node=node: list((_health(etcd_client, keys, node) or records_pb2.HealthRecord())
                                        .unreachable_peers) == ["ghost"], 10, f"{node} reporting only the ghost")


def test_a_worker_blocked_with_its_process_running_has_the_agent_report_a_ring_neighbour_that_does_not_answer(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent) -> None:
    """The workers block in step 5 as in a collective with a peer behind a cut link. Once they
    are quiet (a few step times), long before their stall timeout, the agent checks the members
    after it in the round: the one whose host does not answer at all (an address in the
    discard-only IPv6 prefix) is reported lost; the one that refuses the connection (a host whose
    agent is restarting) is not; the member beyond the ring's reach is not checked."""
    from stalwart.coord.local import free_port

    job = f"ring-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job, peer_probe_neighbours=2, stall_floor=300.0,
                                command=("env", "BLOCK_AT_STEP=5", sys.executable, WORKER)))
    _open_round(etcd_client, keys, 1, [("n0", agent.address), ("cut", "[100::1]:9"),
                                       ("restarting", f"127.0.0.1:{free_port()}"), ("far", "[100::2]:9")])
    wait_for(lambda: list((_health(etcd_client, keys) or records_pb2.HealthRecord()).lost_peers) == ["cut"], 30,
             "n0 reporting the member behind the cut link")
    record = _health(etcd_client, keys)
    assert record is not None and record.lost_peers_round == 1
    assert not any(f.code.startswith("stall") for f in record.findings)  # found while quiet, not stalled


def test_when_no_ring_neighbour_answers_the_agent_accuses_no_one(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        caplog: pytest.LogCaptureFixture) -> None:
    """Both neighbours silent: this node's own link is the likelier cause than two cuts at once,
    so its quiet worker's check reports no one (the daemon would otherwise have two accusations
    from a node that is itself cut off)."""
    job = f"ring-own-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job, peer_probe_neighbours=2, stall_floor=300.0,
                                command=("env", "BLOCK_AT_STEP=5", sys.executable, WORKER)))
    with caplog.at_level("WARNING", logger="stalwart.agent.monitoring"):
        _open_round(etcd_client, keys, 1, [("n0", agent.address), ("cut1", "[100::1]:9"), ("cut2", "[100::2]:9")])
        wait_for(lambda: "no ring neighbour answers" in caplog.text, 30, "the check of the silent neighbours")
    record = _health(etcd_client, keys)
    assert record is not None and list(record.lost_peers) == []


def test_a_health_record_built_before_a_newer_one_never_lands_after_it(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent) -> None:
    """Several threads write the health record. One builds its record, then its etcd write is
    slow; meanwhile a worker failure is found and written by another thread. Had the slow write
    landed last, the daemon would read a record without the failure."""
    import threading

    from stalwart.agent.health import Finding, Severity

    job = f"health-race-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job, command=("sleep", "3600"), workers=1))
    real_put, gate, held = agent.client.put, threading.Event(), threading.Event()

    def put(key: str, value: bytes, lease: int = 0) -> object:
        if key == keys.health("n0") and threading.current_thread().name == "slow-writer":
            held.set()
            gate.wait(30)
        return real_put(key, value, lease=lease)

    agent.client.put = put  # type: ignore[method-assign]
    slow = threading.Thread(target=agent._publish_health, kwargs={"force": True}, name="slow-writer")
    slow.start()
    assert held.wait(10)

    def failure() -> None:
        with agent._lock:
            agent._state.worker_findings.append(Finding("worker", 0, Severity.OK, "exit", "rank 0: exited 1", 1))
        agent._publish_health(force=True)

    newer = threading.Thread(target=failure)
    newer.start()
    # Let the newer write land first if it can (without one writer at a time, it does): a bounded
    # wait that only decides how the old code fails; the right code passes either way.
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not any(
            f.code == "exit" for f in (_health(etcd_client, keys) or records_pb2.HealthRecord()).findings):
        time.sleep(0.02)
    gate.set()
    slow.join(30)
    newer.join(30)
    record = _health(etcd_client, keys)
    assert record is not None and any(f.code == "exit" for f in record.findings), "a stale health record landed last"


def test_drain_cordons_and_stops_workers(etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path,
                                         start_agent) -> None:
    job = f"drain-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job))
    _open_round(etcd_client, keys, 1, [("n0", agent.address)])
    wait_for(lambda: len(_running_steps(agent)) == 2, 30, "workers running")
    reply = _stub(agent).Drain(agent_pb2.DrainRequest(wait=True, timeout=20), timeout=30)
    assert reply.drained, reply.detail
    node = records_pb2.NodeRecord.FromString(etcd_client.get(keys.node("n0")).value)  # type: ignore[union-attr]
    assert node.cordoned
    assert _running_steps(agent) == []
    _open_round(etcd_client, keys, 2, [("n0", agent.address)])  # a drained node does not start workers again
    wait_for(lambda: agent.status().round == 2, 10, "round 2 seen")
    assert _running_steps(agent) == []


def test_committed_checkpoint_of_rank_zero_is_recorded(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                       tmp_path: Path, start_agent) -> None:
    from stalwart.trainer.agent_client import AgentClient

    job = f"ckptrec-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job))
    _open_round(etcd_client, keys, 3, [("n0", agent.address)])
    wait_for(lambda: agent.status().round == 3, 10, "round 3")
    for rank in (1, 0):
        client = AgentClient(str(agent.config.socket_path), rank=rank, local_rank=rank, round_number=3)
        client.checkpoint(120, "/ckpt/step-120", committed=True)
        client.close()
    wait_for(lambda: etcd_client.get(keys.ckpt(120)) is not None, 5, "the commit record")
    record = records_pb2.CheckpointRecord.FromString(etcd_client.get(keys.ckpt(120)).value)  # type: ignore[union-attr]
    assert (record.step, record.path, record.round, record.world_size) == (120, "/ckpt/step-120", 3, 2)
    kvs, _ = etcd_client.get_prefix(keys.ckpt_prefix)
    assert len(kvs) == 1


def test_closed_round_stops_the_workers(etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path,
                                        start_agent) -> None:
    job = f"closed-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job))
    _open_round(etcd_client, keys, 4, [("n0", agent.address)])
    wait_for(lambda: len(_running_steps(agent)) == 2, 30, "workers running")
    record = records_pb2.RoundRecord.FromString(etcd_client.get(keys.round).value)  # type: ignore[union-attr]
    record.closed, record.reason = True, "too few nodes"
    etcd_client.put(keys.round, record.SerializeToString())
    wait_for(lambda: _running_steps(agent) == [], 10, "workers stopped")
    assert agent.status().round == 4


def test_injected_peer_traffic_drop_shows_in_both_directions(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                             tmp_path: Path, start_agent) -> None:
    job = f"drop-{time.monotonic_ns()}"
    keys = JobKeys(job)
    a = start_agent(_config(etcd_server, tmp_path / "a", job))
    b = start_agent(_config(etcd_server, tmp_path / "b", job, node_id="n1"))
    _open_round(etcd_client, keys, 1, [("n0", a.address), ("n1", b.address)])
    _stub(b).InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_DROP_PEERS), timeout=5)
    for node, peer in (("n0", "n1"), ("n1", "n0")):
        wait_for(lambda node=node, peer=peer: list((_health(etcd_client, keys, node) or records_pb2.HealthRecord())
                                                   .unreachable_peers) == [peer], 10, f"{node} not reaching {peer}")
    _stub(b).InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_CLEAR), timeout=5)
    for node in ("n0", "n1"):
        wait_for(lambda node=node: not (_health(etcd_client, keys, node) or records_pb2.HealthRecord())
                 .unreachable_peers, 10, f"{node} reaching its peer again")


STALE = """
import os, sys, time, grpc
from stalwart.proto import agent_pb2, agent_pb2_grpc
channel = grpc.insecure_channel("unix:" + os.environ["STALWART_AGENT_SOCKET"])
def messages():
    yield agent_pb2.WorkerMessage(hello=agent_pb2.Hello(rank=1, local_rank=0, round=1, pid=os.getpid(),
                                                        can_reform=True))
    time.sleep(3600)
for _ in agent_pb2_grpc.ProgressStub(channel).Connect(messages()):
    pass
print("stream ended", flush=True)
time.sleep(3600)
"""


def test_a_stale_worker_of_an_older_round_is_fenced_and_never_takes_the_current_workers_channel(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent, key_prefix: str) -> None:
    """A worker of round 1 that outlived its place (its agent was stopping it when it handed off)
    says Hello to the agent of round 2 for the local rank another process holds: it is killed,
    and the current worker keeps its channel (commands for its rank reach it, not the stale one)."""
    import os
    import subprocess

    job = "agent-" + key_prefix.strip("/").split("/")[-1][-40:].replace("[", "-").replace("]", "")
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job))
    _open_round(etcd_client, keys, 2, [("n0", agent.address)])
    wait_for(lambda: len(_running_steps(agent)) == 2, 30, "two workers stepping")
    holder = next(w.pid for w in agent.status().workers if w.local_rank == 0)
    wait_for(lambda: agent.channels.connected().get(0) == holder, 10, "local rank 0's worker connected")
    stale = subprocess.Popen([sys.executable, "-c", STALE], start_new_session=True,
                             env={**os.environ, "STALWART_AGENT_SOCKET": str(agent.config.socket_path)})
    try:
        stale.wait(timeout=30)
    except subprocess.TimeoutExpired:
        stale.kill()
        raise AssertionError("the stale worker was not fenced") from None
    assert stale.returncode == -9
    assert agent.channels.connected().get(0) == holder
    assert {w.pid for w in agent.status().workers} >= {holder}
