"""The node agent's monitor: health probe, stalls, peers and progress, and the records it writes of them.

The monitor thread samples the health probe, checks stalls and re-form deadlines, and writes the
health record and (rate-limited) progress to etcd; the peer thread pings the round's other
agents. Peers lost to a worker's broken collective, or found by the ring check behind a stall,
go into the health record, so the daemon can act before their leases expire.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
import psutil

from stalwart.agent.config import AgentConfig
from stalwart.agent.core import ring_neighbours
from stalwart.agent.health import Finding, HealthProbe, Severity, verdict
from stalwart.agent.metrics import AgentMetrics
from stalwart.agent.service import health_state
from stalwart.agent.stall import StallDetector
from stalwart.agent.state import NodeState, Progress
from stalwart.agent.stragglers import slower_than_others
from stalwart.agent.throttle import Throttle
from stalwart.agent.workers import WorkerGroup
from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import CoordError
from stalwart.coord.keys import JobKeys
from stalwart.coord.lease import Lease
from stalwart.coord.reach import tcp_probe
from stalwart.proto import agent_pb2, agent_pb2_grpc, records_pb2

log = logging.getLogger(__name__)
# A host's kernel answers a TCP connect within milliseconds however busy its processes are: one
# silent this long is down, or behind a cut link (the daemon's own check uses the same).
HOST_PROBE_TIMEOUT = 0.2
# Seconds between the monitor's looks at the workers (a few /proc reads), and between its polls
# of the health probe (NVML calls, slower).
MONITOR_TICK = 0.1
PROBE_TICK = 0.25


class MonitoringMixin:
    """Mixed into :class:`~stalwart.agent.node.NodeAgent`: its monitor and peer loops and health records."""

    # What it uses of NodeAgent (agent/node.py): attributes set in its __init__ ...
    config: AgentConfig
    client: EtcdClient
    keys: JobKeys
    probe: HealthProbe
    stalls: StallDetector
    metrics: AgentMetrics
    _state: NodeState
    _lock: threading.RLock
    _stop: threading.Event
    _beats: dict[str, float]
    _health_write: threading.Lock
    _probed: list[Finding]
    _lease: Lease | None
    _last_health: bytes
    _last_progress_write: float
    _drop_peers: threading.Event
    _throttles: dict[int, Throttle]
    _unrecorded: dict[int, records_pb2.CheckpointRecord]

    if TYPE_CHECKING:  # ... and the methods it calls that node.py or another part defines
        def _check_reforms(self, now: float) -> None: ...
        def _record_checkpoints(self) -> None: ...
        def _replace_out_of_world(self, rank: int, round_number: int, could_reform: bool, what: str) -> None: ...

    def _peer_loop(self) -> None:
        """Peer probes on a thread of their own: a slow peer must not delay stall detection."""
        while not self._stop.wait(self.config.peer_probe_interval):
            try:
                self._probe_peers()
            except Exception:  # keep probing: one bad address must not end the thread
                log.exception("agent %s: peer probe failed", self.config.node_id)

    def _monitor(self) -> None:
        """Every ``MONITOR_TICK``: a stopped worker is seen within a tick of its frozen limit (the
        whole world waits on it meanwhile); the health probe is polled less often."""
        polled = 0.0
        while not self._stop.wait(min(MONITOR_TICK, self.config.probe_interval)):
            if time.monotonic() - polled >= min(PROBE_TICK, self.config.probe_interval):
                self._poll_probe()
                polled = time.monotonic()
            now = self._beats["monitor"] = time.monotonic()
            self._check_reforms(now)
            with self._lock:
                group = self._state.group
                throttled = set(self._throttles)  # stopped on purpose, in short bursts
                workers = [w for w in group.workers if w.running and w.local_rank not in throttled] \
                    if group is not None else []
            frozen = {w.rank for w in workers if _frozen(w.pid)}
            with self._lock:  # the detector is fed step reports under the lock, on the progress stream's thread
                for w in workers:
                    self.stalls.frozen(w.rank, w.rank in frozen, now)
                quiet = self.stalls.quiet(now)
                stalls = self.stalls.check(now)
            running = {w.rank for w in workers} - frozen
            for rank, last_step in quiet:
                if rank in running:  # blocked, not stopped: on a peer behind a cut link, maybe
                    self._check_ring_once((rank, last_step))
            for stall in stalls:
                log.error("agent %s: rank %d stalled: no step for %.1f s (timeout %.1f s, last step %d)",
                          self.config.node_id, stall.rank, stall.silent_for, stall.timeout, stall.last_step,
                          extra={"node": self.config.node_id, "rank": stall.rank})
                self.metrics.stalls.labels(self.config.node_id).inc()
                with self._lock:
                    group = self._state.group
                    stopped = group is not None and _stopped(group, stall.rank)
                    # A stopped process is this node's fault; a running one is most likely waiting
                    # in a collective for a peer that stalled, so it is not blamed.
                    self._state.worker_findings.append(Finding(
                        "stall", stall.rank, Severity.OK, "stall" if stopped else "stall-waiting",
                        f"rank {stall.rank}: no step for {stall.silent_for:.1f} s (timeout {stall.timeout:.1f} s)"
                        + ("" if stopped else ", process running"),
                        group.assignment.round if group is not None else 0))
                    if stopped and group is not None:
                        # It will be replaced: with no warm spare, the same round that drops it
                        # leaves this node out while one warms (one round, not a second one for
                        # the node to fail when it finds no spare).
                        pid = next((w.pid for w in group.workers if w.rank == stall.rank), None)
                        self._replace_out_of_world(stall.rank, group.assignment.round,
                                                   pid in self._state.can_reform, "stopped")
                if not stopped:
                    self._check_ring_once()
            try:
                self._publish_health()
                self._publish_progress()
                if self._unrecorded:
                    self._record_checkpoints()
            except CoordError as exc:
                log.warning("agent %s: cannot write to etcd: %s", self.config.node_id, exc)

    def findings(self) -> list[Finding]:
        """Probe findings decide the node's verdict. Worker and stall findings are listed with
        severity OK: they say the round broke (the daemon restarts it), not that the node is bad."""
        with self._lock:
            return list(self._probed) + list(self._state.worker_findings)

    def _poll_probe(self) -> None:
        """Sample the health probe (NVML) into ``_probed``: from the monitor loop, never under a
        lock, so a slow or hung driver call delays only that loop (whose stall stops the watchdog),
        not the agent's other work, which reads the last sample."""
        polled = self.probe.poll()
        with self._lock:
            self._probed = polled

    def _health_record(self) -> records_pb2.HealthRecord:
        found = self.findings()
        with self._lock:
            unreachable = list(self._state.unreachable)
            rnd = self._state.round
            lost = sorted(self._state.lost_peers) if rnd is not None and rnd.number == self._state.lost_peers_round \
                else []
        return records_pb2.HealthRecord(
            node_id=self.config.node_id, state=health_state(int(verdict(found))), unreachable_peers=unreachable,
            lost_peers=lost, lost_peers_round=self._state.lost_peers_round if lost else 0,
            replacing=self._state.replacing_since is not None or self._state.warming_since is not None,
            findings=[records_pb2.Finding(source=f.source, device=max(f.device, 0), state=health_state(int(f.severity)),
                                          code=f.code, detail=f.detail, round=f.round) for f in found],
        )

    def _publish_health(self, force: bool = False) -> None:
        """Write the health record. Several threads call this: each builds and writes under one
        lock, so a record built from older state can never land after a newer one (the daemon
        would then miss a worker failure until the stall timeout)."""
        with self._health_write:
            record = self._health_record()
            raw = record.SerializeToString()
            if raw == self._last_health and not force:
                return
            self._last_health = raw
            self.metrics.set_findings([(f.code, records_pb2.HealthState.Name(f.state)) for f in record.findings])
            record.checked_at = time.time()
            lease = self._lease.id if self._lease else 0
            self.client.put(self.keys.health(self.config.node_id), record.SerializeToString(), lease=lease)
        if record.state == records_pb2.HEALTH_FATAL:
            log.error("agent %s: node unhealthy: %s", self.config.node_id,
                      ", ".join(f"{f.code} on device {f.device}" for f in record.findings if f.state == 3))

    def _publish_progress_safe(self) -> None:
        try:
            self._publish_progress()
        except CoordError as exc:
            log.warning("agent %s: cannot write progress to etcd: %s", self.config.node_id, exc)

    def local_stragglers(self) -> dict[int, float]:
        """This node's ranks (by local rank) whose recent busy time exceeds the median of the
        node's other ranks by ``straggler_factor``: busy median of each."""
        with self._lock:
            busy = {p.local_rank: p.busy_median() for p in self._state.progress.values() if p.local_rank >= 0}
        known = {lr: b for lr, b in busy.items() if b > 0}
        return {lr: known[lr] for lr in slower_than_others(known, self.config.straggler_factor)}

    def _publish_progress(self) -> None:
        now = time.monotonic()
        if now - self._last_progress_write < self.config.progress_interval:
            return
        stragglers = sorted(self.local_stragglers())
        with self._lock:
            if self._state.round is None or not (self._state.progress or self._state.gave_up):
                return
            progress = list(self._state.progress.values())
            slowest = min(progress, key=lambda p: p.step) if progress else Progress()
            # the node goes at its slowest rank's pace
            busy = max((p.busy_median() for p in progress), default=0.0)
            record = records_pb2.ProgressRecord(node_id=self.config.node_id, round=self._state.round.number,
                                                step=max(slowest.step, 0), step_time=slowest.step_time,
                                                reported_at=time.time(), busy_time=busy,
                                                straggling_ranks=stragglers, gave_up=bool(self._state.gave_up),
                                                gave_up_reason=self._state.gave_up)
            if self._state.committed_step is not None:
                record.committed_step, record.has_committed_step = self._state.committed_step, True
        self._last_progress_write = now
        lease = self._lease.id if self._lease else 0
        self.client.put(self.keys.progress(self.config.node_id), record.SerializeToString(), lease=lease)

    def _probe_peers(self) -> None:
        with self._lock:
            peers = [m for m in (self._state.round.members if self._state.round else [])
                     if m.node_id != self.config.node_id and m.address]
        unreachable = [p.node_id for p in peers if not self._ping(p.address)]
        with self._lock:
            self._state.unreachable = unreachable

    def worker_joining(self, pid: int, round: int, arrived: int, world_size: int) -> None:
        with self._lock:
            pending = self._state.pending.get(pid)
            if pending is not None and round >= pending.round and not pending.joining:
                self._state.pending[pid] = dataclasses.replace(pending, joining=True)
                log.info("agent %s: pid %d left its old world, joining round %d (%d of %d arrived)",
                         self.config.node_id, pid, round, arrived, world_size,
                         extra={"node": self.config.node_id, "round": round})

    def worker_peer_lost(self, rank: int, round: int, hosts: list[str], detail: str) -> None:
        """A worker's collective of ``round`` broke on peers at ``hosts``: ping the agents of the
        members there (on a thread: a dead host may take the whole timeout) and report those that
        do not answer, so the daemon can act before their leases expire. A host shared by several
        members (or this node's own) names no one and is ignored."""
        node = self.config.node_id
        with self._lock:
            rnd = self._state.round
        if rnd is None or round != rnd.number:
            return
        by_host: dict[str, list[records_pb2.RoundMember]] = {}
        for m in rnd.members:
            if m.address:
                by_host.setdefault(m.address.rsplit(":", 1)[0].strip("[]"), []).append(m)
        suspects = [ms[0] for h, ms in by_host.items() if h in hosts and len(ms) == 1 and ms[0].node_id != node]
        log.warning("agent %s: rank %d lost peers at %s in round %d (%s); checking %s", node, rank, ", ".join(hosts),
                    round, detail.splitlines()[0][:200] if detail else "", [m.node_id for m in suspects] or "no one",
                    extra={"node": node, "rank": rank, "round": round})
        if suspects:
            threading.Thread(target=self._check_lost_peers, args=(round, suspects), daemon=True,
                             name="agent-lost-peers").start()

    def _check_ring_once(self, quiet: tuple[int, int] | None = None) -> None:
        """A worker of this node is blocked in a collective (``quiet``: its rank and last step;
        or stalled, its process running) or in the join of its new round (``JOIN_PROBE_AFTER``):
        the peer it waits on may sit behind a cut link, which nothing sees before its lease
        expires. Check ``peer_probe_neighbours`` members after this node in the round (on a
        thread; once a round for a stall or a join, once per last step for a quiet worker); one
        whose host does not answer at all is reported lost. A host that refuses the connection is
        up (its agent restarts, say): its workers may well be training, so it is not accused. Nor
        is anyone when no neighbour answers (this node's own link is the likelier cause), or when
        the quiet worker made a step meanwhile (its peers are alive)."""
        with self._lock:
            rnd = self._state.round
            if rnd is None:
                return
            if quiet is None:
                if self._state.cut_check_round == rnd.number:
                    return
                self._state.cut_check_round = rnd.number
            else:
                checked_round, checked_step = self._state.cut_quiet_checked
                if checked_round == rnd.number and quiet[1] <= checked_step:
                    return
                self._state.cut_quiet_checked = (rnd.number, quiet[1])
            neighbours = ring_neighbours([m.node_id for m in rnd.members], self.config.node_id,
                                         self.config.peer_probe_neighbours)
            suspects = [m for m in rnd.members if m.node_id in neighbours and m.address]
        still_quiet = None if quiet is None else (lambda: self._still_at(*quiet))
        if suspects:
            threading.Thread(target=self._check_lost_peers, args=(rnd.number, suspects, self._host_gone, still_quiet),
                             daemon=True, name="agent-ring-check").start()

    def _still_at(self, rank: int, step: int) -> bool:
        with self._lock:
            return self.stalls.last_step(rank) == step

    def _host_gone(self, address: str) -> bool:
        """No answer at all to two connects at once (one lost SYN must not accuse a host)."""
        if self._drop_peers.is_set():
            return True
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="agent-host-probe") as pool:
            answers = list(pool.map(lambda _: tcp_probe(address, timeout=HOST_PROBE_TIMEOUT), range(2)))
        return all(a == "none" for a in answers)

    def _check_lost_peers(self, round: int, suspects: list[records_pb2.RoundMember],
                          gone: Callable[[str], bool] | None = None,
                          still_valid: Callable[[], bool] | None = None) -> None:
        """Report the ``suspects`` that are ``gone`` (default: their agent does not answer a Ping),
        asked in parallel: a host behind a cut link takes the whole timeout. A ring check
        (``gone`` given) accuses no one when every one of two or more suspects is gone, or when
        ``still_valid`` says the reason for the check has passed."""
        ring = gone is not None
        gone = gone or (lambda address: not self._ping(address, timeout=0.5))
        with ThreadPoolExecutor(max_workers=max(1, len(suspects)), thread_name_prefix="agent-probe") as pool:
            answers = list(pool.map(lambda m: gone(m.address), suspects))
        lost = {m.node_id for m, g in zip(suspects, answers, strict=True) if g}
        if not lost:
            return
        if ring and len(suspects) >= 2 and len(lost) == len(suspects):
            log.warning("agent %s: round %d: no ring neighbour answers (%s): this node's own link is the likelier "
                        "cause; accusing no one", self.config.node_id, round, ", ".join(sorted(lost)),
                        extra={"node": self.config.node_id, "round": round})
            return
        if still_valid is not None and not still_valid():
            return  # the quiet worker made a step meanwhile: its peers are alive
        with self._lock:
            if self._state.round is None or self._state.round.number != round:
                return  # the world moved on meanwhile
            if self._state.lost_peers_round != round:
                self._state.lost_peers, self._state.lost_peers_round = set(), round
            if lost <= self._state.lost_peers:
                return
            self._state.lost_peers |= lost
        log.error("agent %s: round %d: %s lost (workers' collectives broke or blocked on them, they do not answer)",
                  self.config.node_id, round, ", ".join(sorted(lost)), extra={"node": self.config.node_id,
                                                                             "round": round})
        try:
            self._publish_health(force=True)
        except CoordError as exc:
            log.warning("agent %s: cannot report lost peers: %s", self.config.node_id, exc)

    def _ping(self, address: str, timeout: float = 2.0) -> bool:
        if self._drop_peers.is_set():
            return False
        if self.config.insecure:
            channel = grpc.insecure_channel(address)
        else:
            creds = grpc.ssl_channel_credentials(_read(self.config.tls.ca_file), _read(self.config.tls.key_file),
                                                 _read(self.config.tls.cert_file))
            channel = grpc.secure_channel(address, creds)
        try:
            agent_pb2_grpc.AgentStub(channel).Ping(agent_pb2.PingRequest(from_node=self.config.node_id),
                                                   timeout=timeout)
            return True
        except grpc.RpcError:
            return False
        finally:
            channel.close()


def _frozen(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _stopped(group: WorkerGroup, rank: int) -> bool:
    """Is this rank's process stopped (SIGSTOP, a debugger), rather than blocked or busy?"""
    return any(w.rank == rank and w.running and _frozen(w.pid) for w in group.workers)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()
