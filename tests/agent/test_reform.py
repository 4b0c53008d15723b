"""In-place re-form and warm spares with a real agent, real etcd and real worker processes.

The rounds are written into etcd directly, as the daemon would (the first test waits, like the
daemon, for the agent to report the worker failure before opening the next round). Times are
printed (run with ``-s``), never asserted tightly: the machine is shared.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from stalwart.agent.config import AgentConfig, AgentConfigError
from stalwart.agent.node import NodeAgent
from stalwart.agent.workers import ExitKind
from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.coord.watch import EventType, Watch
from stalwart.proto import agent_pb2, records_pb2
from testkit import process_gone, wait_for

WORKER = str(Path(__file__).with_name("reform_worker.py"))


def _config(etcd: LocalEtcd, tmp_path: Path, job: str, **kw: object) -> AgentConfig:
    settings: dict[str, object] = dict(
        job=job, node_id="n0", command=(sys.executable, WORKER), workers=2, insecure=True,
        etcd=etcd.client_config(), state_dir=str(tmp_path / "state"), lease_ttl=2, probe="fake",
        probe_interval=0.2, fault_injection=True, stall_floor=5.0, stall_factor=10.0, stall_first_step=60.0,
        stop_grace=2.0, progress_interval=0.5, peer_probe_interval=5.0, reform_timeout=10.0,
        spare_nice=0)  # spares at the workers' priority: a loaded test machine would starve niced ones
    settings.update(kw)
    return AgentConfig(**settings)  # type: ignore[arg-type]


def _open_round(client: EtcdClient, keys: JobKeys, number: int, members: list[str], port: int) -> None:
    """Each member runs 2 workers; n0's ranks follow from its place in ``members``."""
    record = records_pb2.RoundRecord(number=number, world_size=2 * len(members), master_addr="127.0.0.1",
                                     master_port=port)
    for i, node in enumerate(members):
        record.members.add(node_id=node, node_rank=i, first_rank=2 * i, local_world_size=2,
                           address="127.0.0.1:1" if node != "n0" else "")
    client.put(keys.round, record.SerializeToString())


def _events(path: Path) -> list[tuple[str, int, int, int, int, int, float]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        kind, pid, rank, ws, rnd, lr, t = line.split()
        out.append((kind, int(pid), int(rank), int(ws), int(rnd), int(lr), float(t)))
    return out


def _workers(agent: NodeAgent, round_number: int, min_step: int = 0) -> dict[int, int]:
    """Local rank -> pid of the workers running (not re-forming) in ``round_number`` past ``min_step``."""
    status = agent.status()
    if status.round != round_number:
        return {}
    return {w.local_rank: w.pid for w in status.workers
            if w.state == agent_pb2.WORKER_RUNNING and w.round == round_number and w.last_step >= min_step}


def _ready_spares(agent: NodeAgent) -> list[int]:
    return [s.pid for s in agent.status().spares if s.ready]


def _job(name: str) -> str:
    return f"{name}-{time.monotonic_ns()}"


def test_survivor_is_reformed_in_place_and_a_spare_takes_the_lost_rank(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job("reform")
    keys = JobKeys(job)
    events = tmp_path / "events"
    monkeypatch.setenv("EVENTS", str(events))  # inherited by the agent's workers and spares
    agent = start_agent(_config(etcd_server, tmp_path, job, spares=1))
    _open_round(etcd_client, keys, 1, ["n0"], 29501)
    wait_for(lambda: len(_workers(agent, 1, min_step=3)) == 2, 30, "two workers stepping in round 1")
    wait_for(lambda: _ready_spares(agent), 30, "a ready spare")
    spare = _ready_spares(agent)[0]
    survivor, victim = _workers(agent, 1)[0], _workers(agent, 1)[1]
    assert spare not in (survivor, victim)

    # the daemon's part: see the failure in the health record, open round 2 with the same member
    killed = time.time()
    os.kill(victim, signal.SIGKILL)

    def failure_reported() -> bool:
        kv = etcd_client.get(keys.health("n0"))
        return kv is not None and any(f.code == "worker-signal"
                                      for f in records_pb2.HealthRecord.FromString(kv.value).findings)

    wait_for(failure_reported, 5, "the worker failure in etcd")
    reported = time.time()
    _open_round(etcd_client, keys, 2, ["n0"], 29502)
    opened = time.time()
    wait_for(lambda: len(_workers(agent, 2, min_step=0)) == 2, 15, "both local ranks acknowledged in round 2")
    acked = time.time()

    got = _events(events)
    reform = [e for e in got if e[0] == "reform" and e[1] == survivor]
    assert [e[2:6] for e in reform] == [(0, 2, 2, 0)]  # rank 0 of 2 in round 2, local rank 0
    assigned = [e for e in got if e[0] == "assigned" and e[1] == spare]
    assert [e[2:6] for e in assigned] == [(1, 2, 2, 1)]
    assert _workers(agent, 2) == {0: survivor, 1: spare}  # the survivor kept its process
    assert not [e for e in got if e[0] == "start" and e[4] == 2]  # no new worker process for round 2
    status = {w.local_rank: w for w in agent.status().workers}
    assert status[0].reformed and status[1].reformed
    logs = list((tmp_path / "state" / "logs" / "round-000002").glob("rank-00001*.log"))
    assert len(logs) == 1 and not logs[0].is_symlink()  # the spare's log moved to the round's naming
    assert (tmp_path / "state" / "logs" / "round-000002" / "rank-00000.log").is_symlink()
    print(f"\nSIGKILL -> failure in etcd {reported - killed:.3f} s; round 2 written at {opened - killed:.3f} s; "
          f"Reform at the survivor {reform[0][6] - killed:.3f} s ({reform[0][6] - opened:.3f} s after the round); "
          f"spare assigned {assigned[0][6] - killed:.3f} s ({assigned[0][6] - opened:.3f} s after the round); "
          f"both acknowledged and stepping by {acked - killed:.3f} s")

    # both make progress in round 2, and a new spare replaces the one taken
    wait_for(lambda: len(_workers(agent, 2, min_step=5)) == 2, 15, "both ranks stepping in round 2")
    wait_for(lambda: [p for p in _ready_spares(agent) if p != spare], 30, "a new ready spare")
    metrics = generate_latest(agent.metrics.registry).decode()
    assert 'stalwart_agent_spare_assignments_total{node="n0"} 1.0' in metrics
    assert 'stalwart_agent_reforms_total{node="n0",outcome="acknowledged"} 2.0' in metrics
    assert 'stalwart_agent_spares{node="n0",state="ready"} 1.0' in metrics

    # a killed spare is just replaced: no worker finding, no round change
    second = _ready_spares(agent)[0]
    os.kill(second, signal.SIGKILL)
    wait_for(lambda: [p for p in _ready_spares(agent) if p not in (spare, second)], 30, "a third spare")
    assert _workers(agent, 2) == {0: survivor, 1: spare}
    kv = etcd_client.get(keys.health("n0"))
    assert kv is not None and not records_pb2.HealthRecord.FromString(kv.value).findings


def test_worker_that_ignores_its_reform_is_killed_and_replaced(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job("ignore")
    keys = JobKeys(job)
    events = tmp_path / "events"
    monkeypatch.setenv("EVENTS", str(events))
    monkeypatch.setenv("IGNORE_REFORM_RANK", "1")
    agent = start_agent(_config(etcd_server, tmp_path, job, reform_timeout=1.5))
    _open_round(etcd_client, keys, 1, ["n0"], 29511)
    wait_for(lambda: len(_workers(agent, 1, min_step=3)) == 2, 30, "two workers stepping in round 1")
    keeper, stubborn = _workers(agent, 1)[0], _workers(agent, 1)[1]
    # round 2: another node comes first, so n0's ranks move from 0, 1 to 2, 3 of 4
    _open_round(etcd_client, keys, 2, ["other", "n0"], 29512)
    opened = time.monotonic()
    wait_for(lambda: process_gone(stubborn),
             10, "the stubborn worker killed")
    took = time.monotonic() - opened
    assert 1.5 <= took < 1.5 + 2.0, took
    wait_for(lambda: len(_workers(agent, 2, min_step=3)) == 2, 30, "both ranks stepping in round 2")
    workers = _workers(agent, 2)
    assert workers[0] == keeper and workers[1] != stubborn
    got = _events(events)
    assert [e[2:6] for e in got if e[0] == "reform" and e[1] == keeper] == [(2, 4, 2, 0)]
    assert [e[2:6] for e in got if e[0] == "reform" and e[1] == stubborn] == [(3, 4, 2, 1)]
    assert [e[2:6] for e in got if e[0] == "start" and e[1] == workers[1]] == [(3, 4, 2, 1)]  # a fresh process
    exit_ = next(e for e in agent._state.exits if e.pid == stubborn)  # noqa: SLF001
    assert exit_.returncode == -signal.SIGKILL and exit_.kind is ExitKind.STOPPED  # the agent's decision
    logs = [p.read_text(errors="replace") for p in tmp_path.rglob("round-000001/rank-00001*.log")]
    assert any("most recent call first" in text for text in logs), "no stack dump in the killed worker's log"
    kv = etcd_client.get(keys.health("n0"))
    assert kv is not None and not records_pb2.HealthRecord.FromString(kv.value).findings  # not a round failure
    print(f"\nunacknowledged re-form: SIGKILL {took:.3f} s after the round (reform_timeout 1.5 s)")


def test_restart_everything_when_reform_in_place_is_off(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job("restart")
    keys = JobKeys(job)
    events = tmp_path / "events"
    monkeypatch.setenv("EVENTS", str(events))
    agent = start_agent(_config(etcd_server, tmp_path, job, reform_in_place=False))
    _open_round(etcd_client, keys, 1, ["n0"], 29521)
    wait_for(lambda: len(_workers(agent, 1, min_step=3)) == 2, 30, "two workers stepping in round 1")
    old = set(_workers(agent, 1).values())
    _open_round(etcd_client, keys, 2, ["n0"], 29522)
    wait_for(lambda: len(_workers(agent, 2, min_step=1)) == 2, 30, "two workers stepping in round 2")
    assert not old & set(_workers(agent, 2).values())
    assert not [e for e in _events(events) if e[0] == "reform"]
    assert not agent.status().spares


def test_worker_without_a_reform_handler_is_restarted(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job("nohandler")
    keys = JobKeys(job)
    events = tmp_path / "events"
    monkeypatch.setenv("EVENTS", str(events))
    monkeypatch.setenv("NO_REFORM", "1")
    agent = start_agent(_config(etcd_server, tmp_path, job))
    _open_round(etcd_client, keys, 1, ["n0"], 29531)
    wait_for(lambda: len(_workers(agent, 1, min_step=3)) == 2, 30, "two workers stepping in round 1")
    old = set(_workers(agent, 1).values())
    _open_round(etcd_client, keys, 2, ["n0"], 29532)
    wait_for(lambda: len(_workers(agent, 2, min_step=1)) == 2, 30, "two workers stepping in round 2")
    assert not old & set(_workers(agent, 2).values())
    assert not [e for e in _events(events) if e[0] == "reform"]


def test_spare_settings_are_validated(etcd_server: LocalEtcd, tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match="spares"):
        _config(etcd_server, tmp_path, "x", spares=1, reform_in_place=False)
    with pytest.raises(AgentConfigError, match="reform_timeout"):
        _config(etcd_server, tmp_path, "x", reform_timeout=0)
    with pytest.raises(AgentConfigError, match="spares"):
        _config(etcd_server, tmp_path, "x", spares=-1)


def test_faults_stalls_and_drain_reach_reformed_workers_and_spares(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import grpc

    from stalwart.proto import agent_pb2_grpc

    job = _job("reform-faults")
    keys = JobKeys(job)
    monkeypatch.setenv("EVENTS", str(tmp_path / "events"))
    agent = start_agent(_config(etcd_server, tmp_path, job, spares=1, stall_floor=1.0, stall_factor=3.0))
    stub = agent_pb2_grpc.AgentStub(grpc.insecure_channel(f"127.0.0.1:{agent.port}"))
    _open_round(etcd_client, keys, 1, ["n0"], 29541)
    wait_for(lambda: len(_workers(agent, 1, min_step=3)) == 2 and _ready_spares(agent), 30, "workers and a spare")
    spare = _ready_spares(agent)[0]
    os.kill(_workers(agent, 1)[1], signal.SIGKILL)
    _open_round(etcd_client, keys, 2, ["n0"], 29542)
    wait_for(lambda: len(_workers(agent, 2, min_step=3)) == 2, 15, "both ranks stepping in round 2")
    assert _workers(agent, 2)[1] == spare
    assert agent.channels.connected()[1] == spare  # the spare's stream now serves local rank 1

    # a hung re-formed worker is a stall of its new rank in its new round
    stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_HANG_WORKER, device=0), timeout=5)

    def findings() -> list[records_pb2.Finding]:
        kv = etcd_client.get(keys.health("n0"))
        return list(records_pb2.HealthRecord.FromString(kv.value).findings) if kv else []

    wait_for(lambda: [f for f in findings() if f.code == "stall"], 10, "the stall of the re-formed worker")
    stall = next(f for f in findings() if f.code == "stall")
    assert (stall.device, stall.round) == (0, 2)
    # the former spare dies: a worker failure of rank 1 in round 2
    stub.InjectFault(agent_pb2.FaultRequest(kind=agent_pb2.FAULT_KILL_WORKER, device=1), timeout=5)
    # (round 1's SIGKILL may be reported after round 2 began: its finding says round 1)
    wait_for(lambda: [f for f in findings() if f.code == "worker-signal" and f.round == 2], 5,
             "the failure of the former spare")
    failure = next(f for f in findings() if f.code == "worker-signal" and f.round == 2)
    assert "rank 1:" in failure.detail
    # round 3: the stopped worker is not kept (it is killed), both places get new processes or spares
    wait_for(lambda: _ready_spares(agent), 30, "a new spare")
    hung = _workers(agent, 2)[0] if 0 in _workers(agent, 2) else agent.status().workers[0].pid
    _open_round(etcd_client, keys, 3, ["n0"], 29543)

    def settled() -> bool:
        no_spare = [f for f in findings() if f.code == "worker-no-spare" and f.round == 3]
        return len(_workers(agent, 3, min_step=1)) == 2 or bool(no_spare)

    wait_for(settled, 30, "both ranks stepping in round 3, or the node leaving it for want of a warm spare")
    last = 3
    if len(_workers(agent, 3, min_step=1)) < 2:
        # Fewer warm spares than lost ranks: the node failed round 3 and asks to leave while one
        # warms. A daemon that cannot do without it keeps it in the next round: then the node
        # starts what it lacks.
        kv = etcd_client.get(keys.health("n0"))
        assert kv is not None and records_pb2.HealthRecord.FromString(kv.value).replacing
        _open_round(etcd_client, keys, 4, ["n0"], 29544)
        last = 4
    wait_for(lambda: len(_workers(agent, last, min_step=1)) == 2, 30, f"both ranks stepping in round {last}")
    assert hung not in _workers(agent, last).values()
    # drain: workers and spares stop, and no spare starts again
    reply = stub.Drain(agent_pb2.DrainRequest(wait=True, timeout=20), timeout=30)
    assert reply.drained, reply.detail
    wait_for(lambda: not agent.status().spares, 10, "spares stopped")
    time.sleep(1.0)
    assert not agent.status().spares and not _workers(agent, 3)


def test_client_reform_handler_gets_pending_reforms_and_spare_needs_an_agent() -> None:
    from stalwart.trainer.agent_client import AgentClient
    from stalwart.trainer.reform import ReformSpec

    client = AgentClient(socket_path="")  # no agent: every call is a no-op
    rnd = records_pb2.RoundRecord(number=5, world_size=4, master_addr="10.0.0.1", master_port=29600,
                                  restore_step=80, has_restore_step=True)
    client._reform(agent_pb2.Reform(round=rnd, rank=3, world_size=4, local_rank=1))  # noqa: SLF001 - as received
    got: list[ReformSpec] = []
    client.set_reform_handler(got.append)
    assert got == [ReformSpec(rank=3, world_size=4, master_addr="10.0.0.1", master_port=29600, round=5,
                              local_rank=1, restore_step=80)]
    client.reformed(5, 3)
    assert (client.rank, client.local_rank, client.round) == (3, 1, 5)
    with pytest.raises(RuntimeError, match="not a spare"):
        client.wait_for_assignment(timeout=0.1)


def test_a_newer_round_before_the_spare_acknowledged_keeps_the_spare(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job("reform-twice")
    keys = JobKeys(job)
    events = tmp_path / "events"
    monkeypatch.setenv("EVENTS", str(events))
    monkeypatch.setenv("ASSIGN_DELAY", "1.0")
    agent = start_agent(_config(etcd_server, tmp_path, job, spares=1, reform_timeout=5.0))
    _open_round(etcd_client, keys, 1, ["n0"], 29551)
    wait_for(lambda: len(_workers(agent, 1, min_step=3)) == 2 and _ready_spares(agent), 30, "workers and a spare")
    spare = _ready_spares(agent)[0]
    survivor = _workers(agent, 1)[0]
    os.kill(_workers(agent, 1)[1], signal.SIGKILL)
    wait_for(lambda: 1 not in _workers(agent, 1), 5, "the victim gone")
    _open_round(etcd_client, keys, 2, ["n0"], 29552)
    wait_for(lambda: [e for e in _events(events) if e[0] == "assigned"], 10, "the spare assigned to round 2")
    _open_round(etcd_client, keys, 3, ["other", "n0"], 29553)  # before the spare acknowledged round 2
    wait_for(lambda: len(_workers(agent, 3, min_step=3)) == 2, 20, "both ranks stepping in round 3")
    assert _workers(agent, 3) == {0: survivor, 1: spare}
    got = _events(events)
    assert [e[2:6] for e in got if e[0] == "reform" and e[1] == spare] == [(3, 4, 3, 1)]
    assert [e[2:6] for e in got if e[0] == "reform" and e[1] == survivor] == [(0, 2, 2, 0), (2, 4, 3, 0)]



def test_a_spare_given_its_rank_while_still_warming_is_not_killed_for_a_late_reform(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank is lost while the node's spare is connected but still warming (a loaded host): the
    spare takes the rank and reads its Reform only once warm, past ``reform_timeout``. It is waited
    for, not killed for "not beginning its re-form", and its re-form is timed from when it is warm."""
    job = _job("reform-warming")
    keys = JobKeys(job)
    events = tmp_path / "events"
    monkeypatch.setenv("EVENTS", str(events))
    monkeypatch.setenv("WARM_DELAY", "3.0")
    agent = start_agent(_config(etcd_server, tmp_path, job, spares=1, reform_timeout=1.5))  # patience 4.5 s
    _open_round(etcd_client, keys, 1, ["n0"], 29571)
    def connected_spares() -> list[int]:  # connected, still warming (status() shows warm ones only)
        return [s.pid for s in agent.spare_pool.status() if s.ready and not s.warm]

    wait_for(lambda: len(_workers(agent, 1, min_step=3)) == 2 and connected_spares(), 30, "workers and a spare")
    spare = connected_spares()[0]
    os.kill(_workers(agent, 1)[1], signal.SIGKILL)
    wait_for(lambda: 1 not in _workers(agent, 1), 5, "the victim gone")
    _open_round(etcd_client, keys, 2, ["n0"], 29572)
    wait_for(lambda: len(_workers(agent, 2, min_step=3)) == 2, 30, "both ranks stepping in round 2")
    assert _workers(agent, 2)[1] == spare  # the warming spare, not a process started after killing it
    assigned = [e for e in _events(events) if e[0] == "assigned" and e[1] == spare]
    assert [e[2:6] for e in assigned] == [(1, 2, 2, 1)], assigned


def test_a_node_that_registers_again_after_the_world_moved_on_asks_to_warm_before_it_is_admitted(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A node whose lease was lost (a cut link) registers again while the rounds it missed are
    still on their way through the watch: round 2, which had it, then round 3, which left it out.
    From the registration on, its health record says ``replacing``: its workers stop once it
    applies round 3 and it has fewer warm spares than workers, so a daemon that admitted it now
    would wait for a cold start; round 2, superseded already, is not applied (being a member of it
    made the node say it was ready)."""
    job = _job("reregister")
    keys = JobKeys(job)
    monkeypatch.setenv("EVENTS", str(tmp_path / "events"))
    agent = start_agent(_config(etcd_server, tmp_path, job, spares=1))
    _open_round(etcd_client, keys, 1, ["n0"], 29561)
    wait_for(lambda: len(_workers(agent, 1, min_step=1)) == 2, 30, "both ranks stepping in round 1")
    held, release = threading.Event(), threading.Event()
    agent._commands.put(("call", lambda: (held.set(), release.wait(30))))  # hold the main loop
    assert held.wait(10), "the agent's main loop did not take the command"
    agent._commands.put(("lease-lost", "a cut link, played by the test"))
    _, revision = etcd_client.get_prefix(keys.health("n0"))
    old_lease = agent._lease.id if agent._lease is not None else 0
    _open_round(etcd_client, keys, 2, ["n0", "n1"], 29562)  # a regrow, superseded at once
    _open_round(etcd_client, keys, 3, ["n1"], 29563)  # the world went on without n0
    watch = Watch(etcd_client, keys.health("n0"), revision + 1)
    records: list[records_pb2.HealthRecord] = []
    caplog.set_level(logging.INFO, logger="stalwart.agent")
    caplog.clear()
    try:
        release.set()  # the registration runs first, then the rounds come through the watch
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not records or _workers(agent, 1) or agent.status().round != 3):
            records += [records_pb2.HealthRecord.FromString(ev.value) for ev in watch.get(timeout=0.5)
                        if ev.type is EventType.PUT and ev.lease != old_lease]
        time.sleep(1.0)  # what the agent writes once round 3 is applied
        records += [records_pb2.HealthRecord.FromString(ev.value) for ev in watch.get(timeout=0.5)
                    if ev.type is EventType.PUT and ev.lease != old_lease]
    finally:
        watch.close()
    assert records, "no health record under the new lease: the node did not register again"
    assert records[0].replacing, records[0]  # the registration's own record
    # Ready again only once its spares are warm (they are quick here), never for round 2's sake.
    ready = [m for m in (r.getMessage() for r in caplog.records) if "ready to join: " in m and "not ready" not in m]
    assert all("warm spare(s) ready" in line for line in ready), ready
    assert agent.status().round == 3 and not _workers(agent, 1)


def test_a_stopped_worker_with_no_warm_spare_asks_to_leave_the_world_as_soon_as_it_is_found_stalled(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGSTOPped worker is replaced; with no warm spare its node says ``replacing`` in the same
    health record that reports the stall, so the daemon's next round leaves the node out while a
    spare warms. Otherwise the daemon would keep the node in that round, the node would fail it
    for want of a spare, and the survivors would re-form twice (the demo's hang cost two rounds)."""
    job = _job("stopped")
    keys = JobKeys(job)
    monkeypatch.setenv("EVENTS", str(tmp_path / "events"))
    monkeypatch.setenv("WARM_DELAY", "120")  # the spare is not warm within the test
    agent = start_agent(_config(etcd_server, tmp_path, job, spares=1, stall_floor=1.0, stall_factor=3.0))
    _open_round(etcd_client, keys, 1, ["n0"], 29571)
    wait_for(lambda: len(_workers(agent, 1, min_step=3)) == 2, 30, "both ranks stepping")
    workers = _workers(agent, 1, min_step=3)
    assert len(workers) == 2

    def health() -> records_pb2.HealthRecord | None:
        kv = etcd_client.get(keys.health("n0"))
        return records_pb2.HealthRecord.FromString(kv.value) if kv is not None else None

    record = health()
    assert record is not None and not record.replacing
    os.kill(workers[1], signal.SIGSTOP)
    try:
        wait_for(lambda: (h := health()) is not None and h.replacing, 30,
                 "the node asking to leave the world while a spare warms")
        record = health()
        assert record is not None and any("no step for" in f.detail for f in record.findings), record
    finally:
        os.kill(workers[1], signal.SIGCONT)


def test_a_reform_stuck_waiting_for_a_member_behind_a_cut_link_has_the_agent_report_it(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent) -> None:
    """Round 2 admits a node whose link was cut as the round opened (its lease still runs): the
    survivor re-forms and waits for it in the join. Its agent checks the ring then, and reports
    the member whose host does not answer, instead of waiting out that node's lease or a stall
    (the stall rules here would take a minute)."""
    job = _job("join-cut")
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job, workers=1, stall_floor=60.0, stall_first_step=60.0,
                                command=("env", "JOIN_FOREVER=1", f"EVENTS={tmp_path / 'events'}", sys.executable,
                                         WORKER)))
    record = records_pb2.RoundRecord(number=1, world_size=1, master_addr="127.0.0.1", master_port=29500)
    record.members.add(node_id="n0", node_rank=0, first_rank=0, local_world_size=1, address=agent.address)
    etcd_client.put(keys.round, record.SerializeToString())
    wait_for(lambda: _workers(agent, 1, min_step=2), 30, "the worker stepping in round 1")
    record = records_pb2.RoundRecord(number=2, world_size=2, master_addr="127.0.0.1", master_port=29501)
    record.members.add(node_id="n0", node_rank=0, first_rank=0, local_world_size=1, address=agent.address)
    record.members.add(node_id="cut", node_rank=1, first_rank=1, local_world_size=1, address="[100::1]:9")
    etcd_client.put(keys.round, record.SerializeToString())

    def lost() -> list[str]:
        kv = etcd_client.get(keys.health("n0"))
        health = records_pb2.HealthRecord.FromString(kv.value) if kv else records_pb2.HealthRecord()
        return list(health.lost_peers) if health.lost_peers_round == 2 else []

    assert wait_for(lost, 30, "n0 reporting the member behind the cut link") == ["cut"]
