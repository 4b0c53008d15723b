"""Adoption of a predecessor's workers: the state file, pid identity, and a stale round fenced."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stalwart.agent.adopt import (
    AdoptedProcess,
    AgentState,
    StateFileError,
    WorkerEntry,
    alive_and_same,
    load_state,
    process_start_time,
    save_state,
)
from stalwart.agent.config import AgentConfig
from stalwart.agent.node import NodeAgent
from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.proto import agent_pb2, records_pb2
from testkit import wait_for

WORKER = str(Path(__file__).with_name("worker_script.py"))


def _config(etcd: LocalEtcd, tmp_path: Path, job: str) -> AgentConfig:
    return AgentConfig(job=job, node_id="n0", command=(sys.executable, WORKER), workers=2, insecure=True,
                       etcd=etcd.client_config(), state_dir=str(tmp_path / "state"), lease_ttl=2, probe="fake",
                       stop_grace=2.0, progress_interval=0.5)


def _open_round(client: EtcdClient, keys: JobKeys, number: int, members: list[tuple[str, str]]) -> None:
    record = records_pb2.RoundRecord(number=number, world_size=2 * len(members), master_addr="127.0.0.1",
                                     master_port=29500)
    for i, (node, address) in enumerate(members):
        record.members.add(node_id=node, node_rank=i, first_rank=2 * i, local_world_size=2, address=address)
    client.put(keys.round, record.SerializeToString())


def _running_steps(agent: NodeAgent) -> list[int]:
    return [w.last_step for w in agent.status().workers if w.state == agent_pb2.WORKER_RUNNING]


def _entry(pid: int, start: int) -> WorkerEntry:
    return WorkerEntry(local_rank=0, rank=3, pid=pid, start_time=start, log_path="/dev/null", can_reform=True)


def test_state_file_round_trip_and_its_refusals(tmp_path: Path) -> None:
    path = tmp_path / "agent-state.json"
    assert load_state(path, "job", "n0") is None
    state = AgentState("job", "n0", 0x1234, b"\x08\x07", (_entry(10, 99),), restarts=4)
    save_state(path, state)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_state(path, "job", "n0") == state
    with pytest.raises(StateFileError, match="node 'n0'"):
        load_state(path, "job", "n1")
    path.write_bytes(b'{"version": 1, "job": "job"')
    with pytest.raises(StateFileError, match="malformed"):
        load_state(path, "job", "n0")
    path.write_bytes(b'{"version": 99}')
    with pytest.raises(StateFileError, match="version"):
        load_state(path, "job", "n0")


def test_a_pid_is_the_same_process_only_with_the_same_start_time() -> None:
    start = process_start_time(os.getpid())
    assert start is not None
    assert alive_and_same(_entry(os.getpid(), start))
    assert not alive_and_same(_entry(os.getpid(), start + 1))  # a recycled pid
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_start_time(child.pid) is None


def test_an_adopted_process_is_waited_for_through_its_pidfd() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    adopted = AdoptedProcess(child.pid)
    ended = threading.Event()
    threading.Thread(target=lambda: (adopted.wait(), ended.set()), daemon=True).start()
    with pytest.raises(subprocess.TimeoutExpired):
        adopted.wait(timeout=0.05)
    assert child.stdin is not None
    child.stdin.close()
    child.wait()  # (our child here: reaped by us, as init reaps an orphaned worker)
    assert ended.wait(10)
    assert adopted.wait(timeout=1) is None  # ended; its status is not ours to read


def _handed_off(config: AgentConfig, client: EtcdClient, keys: JobKeys) -> tuple[list[int], int]:
    """A first agent whose two workers step in round 1, then hands off (``systemctl restart``):
    the workers' pids and the lease it leaves for its successor."""
    first = NodeAgent(config)
    first.start()
    runner = threading.Thread(target=first.run, daemon=True)
    runner.start()
    _open_round(client, keys, 1, [("n0", first.address)])
    wait_for(lambda: len(_running_steps(first)) == 2, 30, "two workers stepping")
    pids = [w.pid for w in first.status().workers]
    assert first._lease is not None
    lease = first._lease.id
    first.handoff()
    runner.join(15)
    assert all(process_start_time(pid) is not None for pid in pids), "a hand-off stopped the workers"
    return pids, lease


def test_workers_of_a_round_that_went_on_without_the_node_are_stopped_by_the_next_agent(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, key_prefix: str) -> None:
    job = "adopt-" + key_prefix.strip("/").split("/")[-1][-40:].replace("[", "-").replace("]", "")
    keys = JobKeys(job)
    config = _config(etcd_server, tmp_path, job)
    pids, _ = _handed_off(config, etcd_client, keys)

    # Meanwhile the job went on without this node: its workers' round is stale.
    _open_round(etcd_client, keys, 2, [("other", "127.0.0.1:1")])
    second = NodeAgent(config)
    second.start()
    runner = threading.Thread(target=second.run, daemon=True)
    runner.start()
    try:
        wait_for(lambda: all(process_start_time(pid) is None for pid in pids), 20,
                 "the stale round's workers stopped")
        # The agent takes the round as its own once the stop has returned, a moment after the
        # processes are gone.
        wait_for(lambda: second.status().round == 2, 20, "the agent on round 2")
        assert not [w for w in second.status().workers if w.state == agent_pb2.WORKER_RUNNING]
    finally:
        second.shutdown()
        runner.join(15)


class _SlowToStart(NodeAgent):
    """A successor whose start takes longer than the lease's TTL before it registers (a busy
    node: binding, reading the round and adopting took seconds)."""

    def _catch_up_round(self) -> None:
        if not getattr(self, "_slowed", False):
            self._slowed = True
            time.sleep(3.0)  # lease_ttl is 2 s
        super()._catch_up_round()


def test_a_successor_slower_to_start_than_the_lease_ttl_carries_on_the_lease(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, key_prefix: str) -> None:
    """The node record stays under the first agent's lease throughout: the daemon never sees the
    node go (it would drop it from a round it forms meanwhile)."""
    job = "carry-" + key_prefix.strip("/").split("/")[-1][-40:]
    keys = JobKeys(job)
    config = _config(etcd_server, tmp_path, job)
    _, lease = _handed_off(config, etcd_client, keys)
    second = _SlowToStart(config)
    second.start()
    runner = threading.Thread(target=second.run, daemon=True)
    runner.start()
    try:
        assert second._lease is not None and second._lease.id == lease
        kv = etcd_client.get(keys.node("n0"))
        assert kv is not None and kv.lease == lease
        wait_for(lambda: len(_running_steps(second)) == 2, 30, "the adopted workers stepping")
    finally:
        second.shutdown()
        runner.join(15)
