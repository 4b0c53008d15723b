"""Training-fault injection through a real agent into real worker processes: the NaN/spike
commands travel over the progress stream, the slow-worker throttle slows a busy worker down."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
import pytest

from stalwart.agent.config import AgentConfig
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
        probe_interval=0.2, fault_injection=True, stall_floor=5.0, stall_factor=10.0, stall_first_step=60.0,
        stop_grace=2.0, progress_interval=0.3, peer_probe_interval=0.5)
    settings.update(kw)
    return AgentConfig(**settings)  # type: ignore[arg-type]


def _open_round(client: EtcdClient, keys: JobKeys, number: int, node: str, address: str, workers: int = 2) -> None:
    record = records_pb2.RoundRecord(number=number, world_size=workers, master_addr="127.0.0.1", master_port=29500)
    record.members.add(node_id=node, node_rank=0, first_rank=0, local_world_size=workers, address=address)
    client.put(keys.round, record.SerializeToString())


def _stub(agent: NodeAgent) -> agent_pb2_grpc.AgentStub:
    return agent_pb2_grpc.AgentStub(grpc.insecure_channel(f"127.0.0.1:{agent.port}"))


def _steps(agent: NodeAgent) -> list[int]:
    return [w.last_step for w in agent.status().workers if w.state == agent_pb2.WORKER_RUNNING]


def test_nan_and_spike_reach_the_workers_fault_handler(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                       tmp_path: Path, start_agent, monkeypatch) -> None:
    fault_log = tmp_path / "faults.txt"
    monkeypatch.setenv("FAULT_LOG", str(fault_log))
    job = f"tfault-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job))
    _open_round(etcd_client, keys, 1, "n0", agent.address)
    wait_for(lambda: len(_steps(agent)) == 2 and min(_steps(agent)) > 1, 30, "two workers stepping")
    wait_for(lambda: len(agent.channels.connected()) == 2, 10, "two progress streams")
    stub = _stub(agent)
    reply = stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_NAN_LOSS, device=1, step=40), timeout=5)
    assert reply.applied and "local rank 1" in reply.detail
    stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_LOSS_SPIKE, device=0, step=7, factor=12.5),
                     timeout=5)
    wait_for(lambda: fault_log.exists() and len(fault_log.read_text().splitlines()) == 2, 10, "both faults handled")
    assert sorted(fault_log.read_text().splitlines()) == ["0 spike 7 12.5", "1 nan 40 0.0"]
    with pytest.raises(grpc.RpcError) as err:  # no such worker
        stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_NAN_LOSS, device=5, step=1), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_training_faults_are_refused_unless_enabled(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                    tmp_path: Path, start_agent) -> None:
    job = f"tfault-off-{time.monotonic_ns()}"
    agent = start_agent(_config(etcd_server, tmp_path, job, fault_injection=False))
    for kind in (agent_pb2.FAULT_NAN_LOSS, agent_pb2.FAULT_LOSS_SPIKE, agent_pb2.FAULT_SLOW_WORKER):
        with pytest.raises(grpc.RpcError) as err:
            _stub(agent).InjectFault(agent_pb2.FaultRequest(kind=kind, device=0, step=1, factor=2), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_slow_worker_gets_about_one_over_factor_of_the_progress(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                                  tmp_path: Path, start_agent, monkeypatch) -> None:
    monkeypatch.setenv("BUSY", "1")
    monkeypatch.setenv("STEP_TIME", "0.02")
    job = f"slow-{time.monotonic_ns()}"
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job))
    _open_round(etcd_client, keys, 1, "n0", agent.address)
    wait_for(lambda: len(_steps(agent)) == 2 and min(_steps(agent)) > 5, 30, "two workers stepping")
    stub = _stub(agent)
    with pytest.raises(grpc.RpcError):  # a factor must slow down
        stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_SLOW_WORKER, device=1, factor=1.0), timeout=5)
    reply = stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_SLOW_WORKER, device=1, factor=2.0), timeout=5)
    assert reply.applied
    assert agent.status().workers[1].slowdown == 2.0

    def progress(seconds: float) -> tuple[int, int]:
        before = _steps(agent)
        time.sleep(seconds)
        after = _steps(agent)
        return after[0] - before[0], after[1] - before[1]

    fast, slow = progress(4.0)
    ratio = slow / fast
    print(f"throttled 2x: {slow} vs {fast} steps, ratio {ratio:.2f}")
    assert 0.35 <= ratio <= 0.65, (fast, slow)
    stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_CLEAR), timeout=5)
    assert agent.status().workers[1].slowdown == 0.0
    fast, slow = progress(3.0)
    print(f"cleared: {slow} vs {fast} steps")
    assert slow / fast > 0.65, (fast, slow)  # equal but for CPU contention

    # the throttle ends on its own when its worker exits, leaving nothing stopped
    stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_SLOW_WORKER, device=0, factor=3.0), timeout=5)
    throttle = agent._throttles[0]
    stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_KILL_WORKER, device=0), timeout=5)
    wait_for(lambda: not throttle.alive, 5, "the throttle to end with its worker")
