"""Simulated agents, daemon processes and a round recorder for the daemon's etcd tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.lease import Lease
from stalwart.coord.local import free_port
from stalwart.coord.watch import EventType, Watch
from stalwart.proto import records_pb2

WAIT = 20.0  # generous bound for anything that should take a few seconds (never a timing assertion)
AGENT_TESTS = Path(__file__).resolve().parents[1] / "agent"
WORKER = str(AGENT_TESTS / "worker_script.py")  # a plain worker: reports steps, no re-form handler
STALWART = str(Path(sys.executable).with_name("stalwart"))


def stop_processes(procs: list[subprocess.Popen[bytes]], grace: float = 15.0) -> None:
    """SIGTERM each process still running, then SIGKILL what has not exited within ``grace``."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()


def agent_process(etcd_endpoint: str, job: str, node: str, tmp_path: Path, script: str = WORKER, extra: str = "",
                  env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A real ``stalwart agent`` process for ``node`` with one worker running ``script``; its log is
    ``tmp_path/<node>.log``. ``extra``: more agent.toml lines (before the [etcd] table)."""
    cfg = tmp_path / f"{node}.toml"
    cfg.write_text(f'''job = "{job}"
node_id = "{node}"
command = ["{sys.executable}", "{script}"]
workers = 1
insecure = true
listen = "127.0.0.1:0"
state_dir = "{tmp_path / node}"
lease_ttl = 2
probe = "fake"
stop_grace = 2.0
{extra}
[etcd]
endpoints = ["{etcd_endpoint}"]
''')
    with open(tmp_path / f"{node}.log", "ab") as log:
        return subprocess.Popen([STALWART, "--log-level", "info", "agent", "--config", str(cfg)], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def new_job() -> str:
    return "j" + uuid.uuid4().hex[:10]


class SimAgent:
    """A node's agent reduced to its etcd writes: a node key under its own lease, health,
    progress. ``stop()`` stops refreshing the lease (a node losing power: the key goes when the
    lease expires); ``register()`` again is the node coming back."""

    def __init__(self, client: EtcdClient, job: str, node_id: str, ttl: int = 2, devices: int = 1) -> None:
        self.client, self.keys, self.node_id, self.ttl, self.devices = client, JobKeys(job), node_id, ttl, devices
        self.lease: Lease | None = None
        self.leases: list[Lease] = []

    def register(self, draining: bool = False) -> SimAgent:
        self.lease = Lease(self.client, self.ttl)
        self.leases.append(self.lease)
        rec = records_pb2.NodeRecord(node_id=self.node_id, address=f"{self.node_id}:7077",
                                     devices=self.devices, hostname=self.node_id, cordoned=draining,
                                     registered_at=time.time())
        self.client.put(self.keys.node(self.node_id), rec.SerializeToString(), lease=self.lease.id)
        return self

    def health(self, state: int = records_pb2.HEALTH_OK, unreachable: tuple[str, ...] = (),
               findings: tuple[records_pb2.Finding, ...] = (), replacing: bool = False) -> None:
        rec = records_pb2.HealthRecord(node_id=self.node_id, state=state, unreachable_peers=list(unreachable),
                                       checked_at=time.time(), findings=list(findings), replacing=replacing)
        self.client.put(self.keys.health(self.node_id), rec.SerializeToString())

    def progress(self, round_number: int, step: int) -> None:
        rec = records_pb2.ProgressRecord(node_id=self.node_id, round=round_number, step=step, step_time=0.1,
                                         reported_at=time.time())
        self.client.put(self.keys.progress(self.node_id), rec.SerializeToString())

    def stop(self) -> None:
        assert self.lease is not None
        self.lease.stop()

    def revoke(self) -> None:
        assert self.lease is not None
        self.lease.revoke()

    def close(self) -> None:
        """Stop every lease thread (before the client closes)."""
        for lease in self.leases:
            lease.stop()


MakeAgent = Callable[[str, str], SimAgent]


def commit_checkpoint(client: EtcdClient, job: str, step: int) -> None:
    rec = records_pb2.CheckpointRecord(step=step, path=f"/ckpt/{step}", world_size=2, committed_at=time.time())
    client.put(JobKeys(job).ckpt(step), rec.SerializeToString())


class RoundLog:
    """Every value written to the job's round key since creation, in order (a watch thread)."""

    def __init__(self, client: EtcdClient, job: str) -> None:
        self.records: list[records_pb2.RoundRecord] = []
        self.times: list[float] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._watch = Watch(client, JobKeys(job).round, 1)
        self._watch.wait_ready(10)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        # Not ``for ev in watch``: that iterator never ends once the watch is closed.
        while not self._stop.is_set():
            for ev in self._watch.get(timeout=0.2):
                if ev.type is not EventType.PUT:
                    continue
                rec = records_pb2.RoundRecord.FromString(ev.value)
                with self._cond:
                    self.records.append(rec)
                    self.times.append(time.monotonic())
                    self._cond.notify_all()

    def wait(self, predicate: Callable[[records_pb2.RoundRecord], bool], timeout: float = WAIT
             ) -> records_pb2.RoundRecord:
        """The first recorded round (oldest first) that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for rec in self.records:
                    if predicate(rec):
                        return rec
                left = deadline - time.monotonic()
                assert left > 0, f"no such round within {timeout} s; rounds: {[members(r) for r in self.records]}"
                self._cond.wait(left)

    def wait_number(self, number: int, timeout: float = WAIT) -> records_pb2.RoundRecord:
        return self.wait(lambda r: r.number == number and not r.closed, timeout)

    @property
    def latest(self) -> records_pb2.RoundRecord | None:
        with self._cond:
            return self.records[-1] if self.records else None

    def close(self) -> None:
        self._stop.set()
        self._watch.close()


def members(rec: records_pb2.RoundRecord) -> list[str]:
    return [m.node_id for m in rec.members]


def check_numbering(records: list[records_pb2.RoundRecord]) -> None:
    """Round numbers go 1, 2, 3, ... with no gap; one number never names two different worlds
    (a record may only be re-written as closed)."""
    seen: dict[int, records_pb2.RoundRecord] = {}
    expected = 1
    for rec in records:
        if rec.number in seen:
            first = seen[rec.number]
            assert rec.closed and not first.closed, f"round {rec.number} written twice"
            assert members(rec) == members(first)
            continue
        assert rec.number == expected, f"round {rec.number} follows round {expected - 1}"
        assert not rec.closed
        seen[rec.number] = rec
        expected += 1


class DaemonProc:
    """``stalwart daemon`` as a real process, its log in ``log_path``."""

    def __init__(self, endpoints: list[str], job: str, log_path: Path, daemon_id: str, *flags: str,
                 env: dict[str, str] | None = None) -> None:
        self.daemon_id = daemon_id
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.log_path = log_path
        args = [sys.executable, "-m", "stalwart.cli.main", "--log-level", "info", "daemon",
                "--endpoints", ",".join(endpoints), "--job", job, "--daemon-id", daemon_id,
                "--lease-ttl", "2", "--tick-interval", "0.2", "--status-interval", "0.2",
                "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--health-host", "127.0.0.1", "--health-port", str(self.health_port), *flags]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def leader_id(client: EtcdClient, job: str, timeout: float = WAIT) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = client.get(JobKeys(job).leader)
        if kv is not None:
            return records_pb2.LeaderRecord.FromString(kv.value).daemon_id
        time.sleep(0.05)
    raise AssertionError(f"no leader within {timeout} s")
