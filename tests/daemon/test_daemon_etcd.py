"""The daemon as a real process against a real etcd, with simulated agents.

Latencies are printed (run with ``-s``), never asserted: the bounds below only stop a test
that would otherwise hang.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from daemon_testlib import (
    WAIT,
    DaemonProc,
    MakeAgent,
    RoundLog,
    check_numbering,
    commit_checkpoint,
    leader_id,
    members,
    new_job,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stalwart.cli.main import main as cli
from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.daemon.observe import LEADER_SERVICE
from stalwart.proto import records_pb2


def _metric(port: int, name: str) -> float | None:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _wait_metric(port: int, name: str, predicate: Callable[[float | None], bool]) -> float | None:
    """The metric once it satisfies ``predicate`` (it is set just after the write it follows)."""
    deadline = time.monotonic() + WAIT
    while True:
        value = _metric(port, name)
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _leader_serving(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=LEADER_SERVICE), timeout=5).status


def test_first_round_shrink_then_regrow_at_next_checkpoint(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                           tmp_path: Path, make_agent: MakeAgent) -> None:
    job = new_job()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(WAIT)
    rounds = RoundLog(etcd_client, job)
    daemon = DaemonProc(etcd_server.endpoints, job, tmp_path / "d.log", "d1", "--min-nodes", "2",
                        "--max-nodes", "3", "--join-timeout", "60", "--regrow-cooldown", "0",
                        env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"})
    try:
        assert b"READY=1" in notify.recv(4096)
        agents = {n: make_agent(job, n).register() for n in ("a", "b", "c")}
        first = rounds.wait_number(1)
        assert members(first) == ["a", "b", "c"]
        assert [m.node_rank for m in first.members] == [0, 1, 2]
        assert not first.has_restore_step

        stopped = time.monotonic()
        agents["c"].stop()  # c's host dies: its lease expires after its TTL
        second = rounds.wait_number(2)
        print(f"lease of c stopped -> round 2 after {rounds.times[-1] - stopped:.2f} s (TTL 2 s)")
        assert members(second) == ["a", "b"]

        agents["a"].progress(2, 5)
        agents["b"].progress(2, 5)  # round 2 trains: newcomers now wait for a checkpoint
        agents["c"].register()
        time.sleep(1.0)
        assert rounds.latest is not None and rounds.latest.number == 2
        commit_checkpoint(etcd_client, job, 10)
        third = rounds.wait_number(3)
        assert members(third) == ["a", "b", "c"] and third.has_restore_step and third.restore_step == 10
        assert third.world_size == 3 and third.master_addr == "a"

        assert _wait_metric(daemon.metrics_port, "stalwart_daemon_round", lambda v: v == 3.0) == 3.0
        assert _metric(daemon.metrics_port, "stalwart_daemon_world_nodes") == 3.0
        assert _leader_serving(daemon.health_port) == health_pb2.HealthCheckResponse.SERVING
        watchdog = b""
        while b"WATCHDOG=1" not in watchdog:
            watchdog = notify.recv(4096)
        check_numbering(rounds.records)
        assert daemon.alive
    finally:
        rc = daemon.stop()
        rounds.close()
        notify.close()
    assert rc == 0, daemon.log()


def test_leader_sigkill_standby_continues_without_skipping_a_round(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                                  tmp_path: Path, make_agent: MakeAgent) -> None:
    job = new_job()
    rounds = RoundLog(etcd_client, job)
    flags = ("--min-nodes", "1", "--max-nodes", "3", "--regrow-cooldown", "0")
    daemons = {i: DaemonProc(etcd_server.endpoints, job, tmp_path / f"{i}.log", i, *flags) for i in ("d1", "d2")}
    try:
        agents = {n: make_agent(job, n).register() for n in ("a", "b", "c")}
        assert members(rounds.wait_number(1)) == ["a", "b", "c"]
        first_leader = leader_id(etcd_client, job)
        standby = "d2" if first_leader == "d1" else "d1"
        daemons[first_leader].kill()  # SIGKILL: the leader key stays until its lease expires
        killed = time.monotonic()
        agents["b"].revoke()  # a node leaves while nobody leads
        second = rounds.wait_number(2)
        print(f"leader SIGKILLed -> round 2 by the standby after {rounds.times[-1] - killed:.2f} s (TTL 2 s)")
        assert members(second) == ["a", "c"] and second.decided_by == standby
        agents["b"].register()  # back: taken in at once (round 2 has not started training)
        third = rounds.wait_number(3)
        assert members(third) == ["a", "c", "b"] and third.decided_by == standby
        check_numbering(rounds.records)
        assert daemons[standby].alive
    finally:
        for d in daemons.values():
            d.stop()
        rounds.close()


def test_holds_and_quarantine_survive_leader_fail_over(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                      tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      make_agent: MakeAgent) -> None:
    job = new_job()
    rounds = RoundLog(etcd_client, job)
    flags = ("--min-nodes", "1", "--max-nodes", "3", "--regrow-cooldown", "0", "--quarantine-faults", "1")
    etcd = ["--endpoints", ",".join(etcd_server.endpoints), "--job", job]
    first = DaemonProc(etcd_server.endpoints, job, tmp_path / "d1.log", "d1", *flags)
    second: DaemonProc | None = None
    try:
        agents = {n: make_agent(job, n).register() for n in ("a", "b", "c")}
        assert members(rounds.wait_number(1)) == ["a", "b", "c"]
        assert cli(["cordon", "c", *etcd]) == 0  # stays in round 1, joins no new round
        agents["b"].revoke()  # one fault is enough to quarantine b
        assert members(rounds.wait_number(2)) == ["a"]

        first.kill()
        second = DaemonProc(etcd_server.endpoints, job, tmp_path / "d2.log", "d2", *flags)
        assert leader_id(etcd_client, job) in ("d1", "d2")
        agents["b"].register()  # quarantined: must stay out under the new leader too
        agents["d"] = make_agent(job, "d").register()
        third = rounds.wait_number(3)
        assert members(third) == ["a", "d"] and third.decided_by == "d2"

        capsys.readouterr()
        assert cli(["status", "--json", *etcd]) == 0
        status = json.loads(capsys.readouterr().out)
        rows = {r["node"]: r for r in status["nodes"]}
        assert "quarantined" in rows["b"]["holds"] and "cordoned" in rows["c"]["holds"]
        assert rows["a"]["place"] == "in world" and rows["c"]["place"] == "waiting"
        assert status["round"]["number"] == 3
        assert cli(["status", *etcd]) == 0
        assert "quarantined" in capsys.readouterr().out

        assert cli(["uncordon", "b", *etcd]) == 0
        assert cli(["uncordon", "c", *etcd]) == 0
        assert members(rounds.wait_number(4)) == ["a", "d", "b"]  # max_nodes=3 leaves c waiting
        check_numbering(rounds.records)
    finally:
        first.stop()
        if second is not None:
            second.stop()
        rounds.close()


def test_a_node_replacing_a_lost_worker_leaves_shows_in_status_and_regrows_once_warm(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        make_agent: MakeAgent) -> None:
    job = new_job()
    rounds = RoundLog(etcd_client, job)
    etcd = ["--endpoints", ",".join(etcd_server.endpoints), "--job", job]
    daemon = DaemonProc(etcd_server.endpoints, job, tmp_path / "d1.log", "d1", "--min-nodes", "2", "--max-nodes",
                        "3", "--regrow-cooldown", "0")
    try:
        agents = {n: make_agent(job, n).register() for n in ("a", "b", "c")}
        first = rounds.wait_number(1)
        assert members(first) == ["a", "b", "c"]
        lost = records_pb2.Finding(source="worker", state=records_pb2.HEALTH_OK, code="worker-signal",
                                   detail="rank 1: killed by SIGKILL", round=first.number)
        agents["b"].health(findings=(lost,), replacing=True)  # one write, as the agent does it
        second = rounds.wait_number(2)
        assert members(second) == ["a", "c"] and "b left out while warming a replacement" in second.reason
        capsys.readouterr()
        assert cli(["status", "--json", *etcd]) == 0
        rows = {r["node"]: r for r in json.loads(capsys.readouterr().out)["nodes"]}
        assert rows["b"]["holds"] == ["replacing"] and rows["b"]["place"] == "waiting"
        for n in ("a", "c"):
            agents[n].progress(second.number, 12)
        etcd_client.put(JobKeys(job).ckpt(10), records_pb2.CheckpointRecord(step=10).SerializeToString())
        time.sleep(1.0)  # a checkpoint while b is still warming: no regrow
        assert rounds.latest is not None and rounds.latest.number == 2
        agents["b"].health(replacing=False)
        for n in ("a", "c"):
            agents[n].progress(second.number, 16)
        etcd_client.put(JobKeys(job).ckpt(15), records_pb2.CheckpointRecord(step=15).SerializeToString())
        third = rounds.wait_number(3)
        assert members(third) == ["a", "c", "b"] and "regrow" in third.reason
    finally:
        daemon.stop()
        rounds.close()


def test_malformed_values_and_unknown_nodes_are_ignored(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                        tmp_path: Path, make_agent: MakeAgent) -> None:
    job = new_job()
    keys = JobKeys(job)
    rounds = RoundLog(etcd_client, job)
    flags = ("--min-nodes", "1", "--max-nodes", "4", "--join-timeout", "1", "--regrow-cooldown", "0")
    first = DaemonProc(etcd_server.endpoints, job, tmp_path / "d1.log", "d1", *flags)
    second: DaemonProc | None = None
    try:
        agents = {n: make_agent(job, n).register() for n in ("a", "b")}
        assert members(rounds.wait_number(1)) == ["a", "b"]
        garbage = b"\xff\xfe not a protobuf \x00\x01"
        for key in (keys.node("x"), keys.health("a"), keys.progress("b"), keys.ckpt(5), keys.cordon("a"),
                    keys.faults("a"), keys.prefix + "nonsense/key"):
            etcd_client.put(key, garbage)
        ghost = make_agent(job, "ghost")
        ghost.health(records_pb2.HEALTH_FATAL)  # a node id nobody registered
        ghost.progress(1, 100)
        wrong = records_pb2.NodeRecord(node_id="someone-else", address="h:1", devices=1)
        etcd_client.put(keys.node("y"), wrong.SerializeToString())  # record contradicts its key
        agents["c"] = make_agent(job, "c").register()
        assert members(rounds.wait_number(2)) == ["a", "b", "c"]
        assert first.alive
        ignored = _wait_metric(first.metrics_port, "stalwart_daemon_ignored_values_total", lambda v: (v or 0) >= 1)
        assert ignored is not None and ignored >= 1

        first.kill()  # the next leader reads all of that garbage when it takes over
        second = DaemonProc(etcd_server.endpoints, job, tmp_path / "d2.log", "d2", *flags)
        agents["a"].revoke()
        assert members(rounds.wait_number(3)) == ["b", "c"]
        assert second.alive
        check_numbering(rounds.records)
    finally:
        first.stop()
        if second is not None:
            second.stop()
        rounds.close()


@pytest.mark.parametrize("policy", ["min_nodes = 5\nmax_nodes = 3\n", "min_nodes = 1\nmax_nodez = 3\n"])
def test_bad_config_exits_with_an_error(tmp_path: Path, policy: str) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "daemon.toml"
    cfg.write_text(f'[daemon]\njob = "j"\n[policy]\n{policy}')
    res = subprocess.run([sys.executable, "-m", "stalwart.cli.main", "daemon", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=WAIT)
    assert res.returncode == 2
    assert "daemon.toml" in res.stderr and "Traceback" not in res.stderr
