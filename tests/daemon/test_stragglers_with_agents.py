"""Stragglers and a job that gives up, end to end: a real daemon, real agents, real workers.

A 3-node gloo job (one worker per node, tests/agent/gloo_worker.py): the agent of one node slows
its worker 2x (FAULT_SLOW_WORKER); every rank's wall step time stays equal (they meet in the
all-reduce) but the slowed node's busy time doubles, and the daemon reports it as a straggler;
with exclude_stragglers it leaves the world at the next checkpoint.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from daemon_testlib import DaemonProc, RoundLog, agent_process, members, new_job

from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd, free_port
from stalwart.daemon.status import format_table, read_status
from stalwart.proto import agent_pb2, agent_pb2_grpc, records_pb2
from testkit import wait_for

AGENT_TESTS = Path(__file__).resolve().parents[1] / "agent"
GLOO_WORKER = str(AGENT_TESTS / "gloo_worker.py")
WORKER = str(AGENT_TESTS / "worker_script.py")
STALWART = str(Path(sys.executable).with_name("stalwart"))
pytestmark = pytest.mark.timeout(240)

RPC = (grpc.RpcError,)  # an agent or daemon not answering yet: try again


def _agent(etcd: LocalEtcd, job: str, node: str, tmp_path: Path, script: str,
           env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    extra = "fault_injection = true\nprogress_interval = 0.1\nbusy_window = 5\nstall_first_step = 60.0"
    return agent_process(etcd.endpoints[0], job, node, tmp_path, script, extra=extra,
                         env={"OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture
def cluster(etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path) -> Iterator[Callable[..., object]]:
    procs: list[subprocess.Popen[bytes]] = []
    daemons: list[DaemonProc] = []
    logs: list[RoundLog] = []

    def start_agent(*args: object, **kw: object) -> subprocess.Popen[bytes]:
        procs.append(_agent(etcd_server, *args, **kw))  # type: ignore[arg-type]
        return procs[-1]

    def start_daemon(job: str, *flags: str) -> DaemonProc:
        daemons.append(DaemonProc(etcd_server.endpoints, job, tmp_path / "daemon.log", "d1", *flags))
        return daemons[-1]

    def round_log(job: str) -> RoundLog:
        logs.append(RoundLog(etcd_client, job))
        return logs[-1]

    try:
        yield start_agent, start_daemon, round_log  # type: ignore[misc]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        for d in daemons:
            d.stop()
        for r in logs:
            r.close()


def _node_stub(client: EtcdClient, job: str, node: str) -> agent_pb2_grpc.AgentStub:
    record = records_pb2.NodeRecord.FromString(client.get(JobKeys(job).node(node)).value)  # type: ignore[union-attr]
    return agent_pb2_grpc.AgentStub(grpc.insecure_channel(record.address))


def _progress(client: EtcdClient, job: str, node: str) -> records_pb2.ProgressRecord | None:
    kv = client.get(JobKeys(job).progress(node))
    return records_pb2.ProgressRecord.FromString(kv.value) if kv else None


def _daemon_status(client: EtcdClient, job: str) -> records_pb2.DaemonStatus:
    kv = client.get(JobKeys(job).status)
    return records_pb2.DaemonStatus.FromString(kv.value) if kv else records_pb2.DaemonStatus()


def _slow_node(client: EtcdClient, job: str, tmp_path: Path) -> tuple[int, float]:
    """Wait for training, slow n1's worker 2x; the step then, and when."""
    wait_for(lambda: all((p := _progress(client, job, n)) and p.step >= 15 and p.busy_time > 0
                         for n in ("n0", "n1", "n2")), 90, "three nodes training", tmp_path, retry_on=RPC)
    reply = _node_stub(client, job, "n1").InjectFault(
        agent_pb2.FaultRequest(kind=agent_pb2.FAULT_SLOW_WORKER, device=0, factor=2.0), timeout=5)
    assert reply.applied
    return _progress(client, job, "n1").step, time.monotonic()  # type: ignore[union-attr]


def test_a_2x_slowed_worker_is_reported_as_a_straggler(etcd_client: EtcdClient, tmp_path: Path,
                                                       cluster) -> None:  # type: ignore[no-untyped-def]
    start_agent, start_daemon, round_log = cluster
    job = new_job()
    rounds = round_log(job)
    daemon = start_daemon(job, "--min-nodes", "3", "--max-nodes", "3", "--master-port", str(free_port()),
                          "--straggler-steps", "3")
    # 0.1 s of compute a step (still short for training): with 30 ms steps, three busy workers on
    # two cores and a 20 ms throttle cycle make each step's busy time noisy, and the count is
    # bounded by the 0.1 s report interval rather than by steps.
    for n in ("n0", "n1", "n2"):
        start_agent(job, n, tmp_path, GLOO_WORKER, env={"WORK": "0.1"})
    assert members(rounds.wait_number(1, timeout=60)) == ["n0", "n1", "n2"]
    assert not _daemon_status(etcd_client, job).stragglers
    slowed_at, t0 = _slow_node(etcd_client, job, tmp_path)
    status = wait_for(lambda: (s := _daemon_status(etcd_client, job)).stragglers and s, 60, "a straggler", tmp_path,
                      retry_on=RPC)
    took = time.monotonic() - t0
    [s] = status.stragglers  # type: ignore[attr-defined]
    found_at = _progress(etcd_client, job, "n0").step  # type: ignore[union-attr]
    print(f"2x straggler reported after {found_at - slowed_at} steps ({took:.1f} s): busy {s.busy_time:.3f} "
          f"s/step vs {s.others_median:.3f} s, {s.consecutive} reports since step {s.since_step}")
    assert s.node_id == "n1" and not s.excluded
    assert s.busy_time > 1.5 * s.others_median
    assert found_at - slowed_at <= 20, (slowed_at, found_at)
    # wall step times stay alike: the others wait for n1 in the all-reduce
    walls = {n: _progress(etcd_client, job, n).step_time for n in ("n0", "n1", "n2")}  # type: ignore[union-attr]
    assert max(walls.values()) < 1.6 * min(walls.values()), walls
    table = format_table(read_status(etcd_client, job))
    assert "straggler: n1" in table and "[straggler]" in table, table
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read().decode()
    assert 'stalwart_daemon_straggler{node="n1"} 1.0' in metrics, metrics[-2000:]
    assert rounds.latest is not None and rounds.latest.number == 1  # only reported: no exclusion


def test_with_exclude_stragglers_the_straggler_leaves_at_the_next_checkpoint(
        etcd_client: EtcdClient, tmp_path: Path, cluster) -> None:  # type: ignore[no-untyped-def]
    start_agent, start_daemon, round_log = cluster
    job = new_job()
    rounds = round_log(job)
    start_daemon(job, "--min-nodes", "2", "--max-nodes", "3", "--master-port", str(free_port()),
                 "--straggler-steps", "3", "--exclude-stragglers", "true")
    for n in ("n0", "n1", "n2"):
        start_agent(job, n, tmp_path, GLOO_WORKER, env={"CKPT_EVERY": "15"})
    assert members(rounds.wait_number(1, timeout=60)) == ["n0", "n1", "n2"]
    _slow_node(etcd_client, job, tmp_path)
    status = wait_for(lambda: (s := _daemon_status(etcd_client, job)).stragglers and s, 60, "a straggler", tmp_path,
                      retry_on=RPC)
    detected_step = status.stragglers[0].since_step  # type: ignore[attr-defined]
    second = rounds.wait_number(2, timeout=60)
    assert members(second) == ["n0", "n2"], members(second)
    assert "n1 drained by daemon" in second.reason and "straggler" in second.reason, second.reason
    assert second.restore_step > detected_step  # left at a checkpoint taken after it was found
    hold = records_pb2.CordonRecord.FromString(etcd_client.get(JobKeys(job).cordon("n1")).value)  # type: ignore[union-attr]
    assert hold.kind == records_pb2.HOLD_DRAIN and "straggler" in hold.reason and hold.by.startswith("daemon")
    wait_for(lambda: any(s.node_id == "n1" and s.excluded for s in _daemon_status(etcd_client, job).stragglers),
             10, "the excluded straggler in the status record", tmp_path, retry_on=RPC)
    wait_for(lambda: (p := _progress(etcd_client, job, "n0")) and p.round == 2 and p.step > second.restore_step + 3,
             60, "round 2 training without n1", tmp_path, retry_on=RPC)


def test_a_worker_that_gives_up_closes_the_job(etcd_client: EtcdClient, tmp_path: Path,
                                               cluster) -> None:  # type: ignore[no-untyped-def]
    start_agent, start_daemon, round_log = cluster
    job = new_job()
    rounds = round_log(job)
    start_daemon(job, "--min-nodes", "2", "--max-nodes", "2", "--master-port", str(free_port()))
    start_agent(job, "n0", tmp_path, WORKER)
    start_agent(job, "n1", tmp_path, WORKER, env={"EXIT_AT_STEP": "5", "EXIT_CODE": "3"})
    assert members(rounds.wait_number(1, timeout=60)) == ["n0", "n1"]
    closed = rounds.wait(lambda r: r.number == 1 and r.closed, timeout=30)
    assert closed.reason.startswith("the job gave up") and "n1" in closed.reason, closed.reason
    wait_for(lambda: _daemon_status(etcd_client, job).reason.startswith("the job gave up"), 10, "the status", tmp_path,
             retry_on=RPC)
    time.sleep(3)  # no restart follows
    assert [r.number for r in rounds.records] == [1, 1], [(r.number, r.closed, r.reason) for r in rounds.records]
    table = format_table(read_status(etcd_client, job))
    assert "the job gave up" in table, table
