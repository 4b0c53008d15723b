"""Following the rounds and re-forming into each: the part of the node agent that applies round changes.

A round watch (:meth:`RoundsMixin._follow_rounds`) feeds round records to the main loop, which
applies them (:meth:`RoundsMixin._apply_round`): with ``reform_in_place``, kept workers are sent
``Reform`` with their new rank, empty local ranks take a warm spare (else a new process) and what
is left of the old round is stopped; without, every worker stops and new ones start. The monitor
loop checks the re-forms not acknowledged in time (:meth:`RoundsMixin._check_reforms`). Which
workers to keep and when a re-form is overdue are ``core.py``'s decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import psutil

from stalwart.agent.config import AgentConfig
from stalwart.agent.core import ProcState, WorkerFacts, keep_verdict, overdue_reform
from stalwart.agent.health import Finding, Severity
from stalwart.agent.metrics import AgentMetrics
from stalwart.agent.preload import Preloader
from stalwart.agent.service import WorkerChannels
from stalwart.agent.spares import SparePool
from stalwart.agent.stall import StallDetector
from stalwart.agent.state import NodeState, PendingReform
from stalwart.agent.throttle import Throttle
from stalwart.agent.workers import RoundAssignment, Worker, WorkerExit, WorkerGroup
from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import CoordError
from stalwart.coord.keys import JobKeys
from stalwart.coord.watch import EventType, Watch
from stalwart.proto import agent_pb2, records_pb2

log = logging.getLogger(__name__)

# A spare given its rank while still warming up is not killed for a late re-form until this many
# reform_timeouts have passed: warming on a loaded host takes long, but a spare that never gets
# warm must not hold its round forever.
WARMING_PATIENCE = 3
# A re-form still waiting for its new peers this long after it was sent (a join takes 0.05-0.2 s
# here) has the agent check its ring neighbours: one behind a cut link is reported lost.
JOIN_PROBE_AFTER = 0.5


class RoundsMixin:
    """Mixed into :class:`~stalwart.agent.node.NodeAgent`: round changes, applied on its main loop."""

    # What it uses of NodeAgent (agent/node.py): attributes set in its __init__ ...
    config: AgentConfig
    client: EtcdClient
    keys: JobKeys
    stalls: StallDetector
    metrics: AgentMetrics
    channels: WorkerChannels
    spare_pool: SparePool
    preloader: Preloader | None
    _state: NodeState
    _lock: threading.RLock
    _commands: queue.Queue[tuple[str, object]]
    _stop: threading.Event
    _watch: Watch | None
    _throttles: dict[int, Throttle]
    _step_clock: dict[int, tuple[float, str]]

    if TYPE_CHECKING:  # ... and the methods it calls that node.py or another part defines
        def _worker_env(self) -> dict[str, str]: ...
        def _end_replacing(self, why: str) -> None: ...
        def _stop_in_background(self, workers: list[Worker], grace: float) -> None: ...
        def _stop_workers(self, why: str, wait: bool = False) -> None: ...
        def _update_readiness(self) -> None: ...
        def _worker_exited(self, exit_: WorkerExit) -> None: ...
        def _publish_health(self, force: bool = False) -> None: ...
        def _check_ring_once(self, quiet: tuple[int, int] | None = None) -> None: ...
        def _clear_throttles(self, keep: dict[int, int] | None = None) -> None: ...

    def _follow_rounds(self) -> None:
        while not self._stop.is_set():
            watch = self._watch
            assert watch is not None
            try:
                events = watch.get(timeout=1.0)
            except CoordError as exc:
                # The watch ended (history compacted, permissions): read the round again and watch
                # from there; applying a round twice is harmless.
                log.error("agent %s: round watch failed (%s); re-reading", self.config.node_id, exc)
                watch.close()
                self._watch = self._rewatch()
                continue
            for ev in events:
                if ev.type is EventType.PUT:
                    self._commands.put(("round", ev.value))

    def _read_and_watch_round(self) -> Watch:
        """Apply the current round, then watch from the revision it was read at: a round
        written between the read and the watch's start is not missed."""
        kvs, revision = self.client.get_prefix(self.keys.round)
        for kv in kvs:
            if kv.key == self.keys.round:
                self._commands.put(("round", kv.value))
        return Watch(self.client, self.keys.round, revision + 1)

    def _rewatch(self) -> Watch:
        while not self._stop.is_set():
            try:
                return self._read_and_watch_round()
            except CoordError as exc:
                log.error("agent %s: cannot read the round: %s", self.config.node_id, exc)
                self._stop.wait(1.0)
        return Watch(self.client, self.keys.round, 0)

    def _apply_round(self, raw: bytes) -> None:
        try:
            record = records_pb2.RoundRecord.FromString(raw)
        except Exception:
            log.error("agent %s: round record is not a RoundRecord; ignored", self.config.node_id)
            return
        with self._lock:
            current = self._state.round
            if current is not None and (record.number < current.number or (
                    record.number == current.number and (current.closed or not record.closed))):
                return  # old news; the one change a round number can see is being closed
            seen = self._state.seen_round
            if seen is not None and record.number < seen.number:
                # A round already superseded (registering again read a newer one, which the watch
                # brings next): applying it would re-form workers for a world that will not form
                # and, worse, say this node is ready because it was a member of that one.
                return
        mine = [m for m in record.members if m.node_id == self.config.node_id]
        with self._lock:
            self._state.seen_round = record
        self._update_readiness()
        with self._lock:
            self._state.worker_findings = []  # they were about the round that just ended
            self._state.gave_up = ""
            kept_anyway = bool(mine) and self._state.replacing_since is not None  # the daemon could not do without us
            if kept_anyway:
                self._end_replacing("back in the world")
        if self.config.reform_in_place and mine and not record.closed and not self._state.draining:
            self._join_in_place(record, self._assignment(record, mine[0]), cold_ok=kept_anyway)
            return
        self._stop_workers(f"round {record.number} {'closed: ' + record.reason if record.closed else 'opened'}")
        with self._lock:
            self._state.round = record
        if record.closed:
            return
        if not mine or self._state.draining:
            log.info("agent %s: not a member of round %d", self.config.node_id, record.number,
                     extra={"node": self.config.node_id, "round": record.number})
            return
        assignment = self._assignment(record, mine[0])
        now = time.monotonic()
        group = WorkerGroup(self.config.command, assignment, self.config.log_dir, self._worker_exited,
                            extra_env=self._worker_env(), cwd=self.config.cwd, preloader=self.preloader)
        with self._lock:
            self._state.group = group
            self._state.worker_findings = []
            self._state.progress = {}
            for w in group.workers:
                self.stalls.started(w.rank, now)
                self._step_clock[w.rank] = (now, "startup")
        self._joined(record)

    def _assignment(self, record: records_pb2.RoundRecord, m: records_pb2.RoundMember) -> RoundAssignment:
        return RoundAssignment(
            round=record.number, group_rank=m.node_rank, first_rank=m.first_rank,
            local_world_size=m.local_world_size or self.config.workers, world_size=record.world_size,
            master_addr=record.master_addr, master_port=record.master_port,
            restore_step=record.restore_step if record.has_restore_step else None,
            restart_count=self._state.restarts,
        )

    def _joined(self, record: records_pb2.RoundRecord) -> None:
        self._state.restarts += 1
        self.metrics.restarts.labels(self.config.node_id).inc()
        self.metrics.round.labels(self.config.node_id).set(record.number)
        self._publish_health(force=True)

    def _unfit(self, w: Worker, assignment: RoundAssignment, connected: dict[int, int],
               spare_streams: set[int]) -> tuple[str, bool] | None:
        """Why ``w`` cannot be kept for the new round, and whether it is unhealthy (killed at
        once rather than given its SIGTERM grace); None when it is kept (``core.keep_verdict``).
        Caller holds the lock."""
        # A spare told to re-form in the round before keeps its spare stream until it acknowledges.
        reforming = w.pid in self._state.pending and w.pid in spare_streams
        verdict = keep_verdict(WorkerFacts(
            running=w.running, stopping=w.stopping, local_rank=w.local_rank,
            connected=connected.get(w.local_rank) == w.pid, reforming=reforming,
            stalled=self.stalls.stalled(w.rank), proc=self._proc_state(w.local_rank, w.pid) if w.running
            else ProcState.EXITED,
            can_reform=w.pid in self._state.can_reform), assignment.local_world_size)
        return None if verdict.keep else (verdict.why, verdict.unhealthy)

    def _join_in_place(self, record: records_pb2.RoundRecord, assignment: RoundAssignment,
                       cold_ok: bool = False) -> None:
        """Re-form into ``record``: Reform to kept workers first (the fast path), then spares into
        empty local ranks, then stop what is left of the old round, then start new processes —
        for a lost worker only with ``cold_ok`` (the daemon kept this node though it asked to
        leave while a spare warms), else the node fails the round and asks to leave."""
        node, now = self.config.node_id, time.monotonic()
        connected, spare_streams = self.channels.connected(), self.channels.spares()
        keep: dict[int, Worker] = {}
        drop: list[tuple[Worker, str, bool]] = []
        with self._lock:
            old = self._state.group
            for w in (old.workers if old is not None else []):
                unfit = self._unfit(w, assignment, connected, spare_streams)
                if unfit is None:
                    keep[w.local_rank] = w
                elif w.running:
                    drop.append((w, *unfit))
                self.stalls.forget(w.rank)
            self._state.pending = {}
            group = WorkerGroup(self.config.command, assignment, self.config.log_dir, self._worker_exited,
                                extra_env=self._worker_env(), cwd=self.config.cwd, preloader=self.preloader,
                                reuse=keep, spawn_missing=False)
            self._state.group = group
            self._state.round = record
            self._state.progress = {}
            self._state.worker_findings = []
        # An injected slow-down stays with a kept process (a slow device stays slow in the next
        # round) and ends with any other.
        self._clear_throttles(keep={lr: w.pid for lr, w in keep.items()})
        log.info("agent %s: round %d: keeping %d worker(s) in place, %d to stop, %d to fill", node, record.number,
                 len(keep), len(drop), len(group.missing()), extra={"node": node, "round": record.number})
        for w in list(keep.values()):
            if not self._send_reform(group, w, record, now):
                keep.pop(w.local_rank)
                drop.append((w, "could not be told to re-form", True))
        for lr in group.missing():
            spare = self.spare_pool.take()
            if spare is None:
                break
            self._adopt_spare(group, lr, spare, record, now)
        for w, why, _ in drop:
            log.info("agent %s: round %d: stopping rank %d (pid %d): %s", node, record.number, w.rank, w.pid, why,
                     extra={"node": node, "rank": w.rank, "round": record.number})
        self._stop_in_background([w for w, _, unhealthy in drop if unhealthy], 0.0)
        self._stop_in_background([w for w, _, unhealthy in drop if not unhealthy], self.config.stop_grace)
        if group.missing() and old is not None and self.config.spares > 0 and not cold_ok:
            # A worker of ours was lost and no spare can take its rank: a new process would hold
            # the whole round up for its start. Fail the round and leave it while a spare warms;
            # only when the daemon cannot do without this node (it is still a member of the next
            # round though replacing) does a new process start.
            with self._lock:
                self._state.replacing_since = time.monotonic()
                self.spare_pool.wanted = max(self.spare_pool.wanted, self.config.workers)
                for lr in group.missing():
                    self._state.worker_findings.append(Finding(
                        "worker", lr, Severity.OK, "worker-no-spare",
                        f"local rank {lr}: no warm spare to take its rank; leaving the round while one warms",
                        record.number))
            log.warning("agent %s: round %d: no warm spare for local rank(s) %s: leaving the round while one warms",
                        node, record.number, group.missing(), extra={"node": node, "round": record.number})
            self._joined(record)
            return
        for lr in group.missing():
            spawned = group.spawn(lr)
            with self._lock:
                self.stalls.started(spawned.rank, time.monotonic())
                self._step_clock[spawned.rank] = (time.monotonic(), "startup")
        self._joined(record)

    def _send_reform(self, group: WorkerGroup, w: Worker, record: records_pb2.RoundRecord, now: float) -> bool:
        """Tell a live process its place in ``record``; False (and the place emptied) if it is not
        connected."""
        command = agent_pb2.AgentCommand(reform=agent_pb2.Reform(round=record, rank=w.rank,
                                                                 world_size=record.world_size,
                                                                 local_rank=w.local_rank))
        with self._lock:
            self._state.pending[w.pid] = PendingReform(record.number, w.local_rank, w.rank, now,
                                                        now + self.config.reform_timeout, warming=w.warming)
            self.stalls.started(w.rank, now)
            self._step_clock[w.rank] = (now, "re-form")
        if self.channels.send_pid(w.pid, command):
            self.metrics.reforms.labels(self.config.node_id, "sent").inc()
            log.info("agent %s: round %d: re-form sent to rank %d (pid %d, local rank %d) of %d", self.config.node_id,
                     record.number, w.rank, w.pid, w.local_rank, record.world_size,
                     extra={"node": self.config.node_id, "rank": w.rank, "round": record.number})
            return True
        with self._lock:
            self._state.pending.pop(w.pid, None)
            self.stalls.forget(w.rank)
            group.release(w.local_rank)
        self.metrics.reforms.labels(self.config.node_id, "undeliverable").inc()
        return False

    def _adopt_spare(self, group: WorkerGroup, local_rank: int, spare: Worker, record: records_pb2.RoundRecord,
                     now: float) -> bool:
        with self._lock:
            group.adopt(local_rank, spare)
        if not self._send_reform(group, spare, record, now):
            spare.kill()
            return False
        self.metrics.spare_assignments.labels(self.config.node_id).inc()
        log.info("agent %s: round %d: spare (pid %d) takes rank %d (local rank %d)", self.config.node_id,
                 record.number, spare.pid, spare.rank, local_rank,
                 extra={"node": self.config.node_id, "rank": spare.rank, "round": record.number})
        return True

    def _refill(self, round_number: int, local_rank: int, pid: int) -> None:
        """Give an emptied local rank of the current round a spare, else a new process (a worker
        that did not acknowledge its re-form was killed)."""
        with self._lock:
            group, record = self._state.group, self._state.round
            if group is None or record is None or record.number != round_number or record.closed:
                return  # the round moved on; its own re-form filled every place
            w = group.worker(local_rank)
            if w is not None and w.pid != pid:
                return
            group.release(local_rank)
        if w is not None:
            try:
                w.proc.wait(timeout=2)
            except Exception:
                log.warning("agent %s: killed pid %d has not exited yet", self.config.node_id, pid)
        now = time.monotonic()
        spare = self.spare_pool.take()
        if spare is not None and self._adopt_spare(group, local_rank, spare, record, now):
            return
        if group.worker(local_rank) is None:
            spawned = group.spawn(local_rank)
            with self._lock:
                self.stalls.started(spawned.rank, now)
                self._step_clock[spawned.rank] = (now, "startup")

    def _proc_state(self, local_rank: int, pid: int) -> ProcState:
        """The process's state, where a slow-down injected on purpose (stopped in short bursts)
        counts as running."""
        state = _proc_state(pid)
        throttle = self._throttles.get(local_rank)
        if state is ProcState.STOPPED and throttle is not None and throttle.pgid == pid and throttle.alive:
            return ProcState.RUNNING
        return state

    def _check_reforms(self, now: float) -> None:
        """Workers whose re-form is overdue (``core.overdue_reform``): one that is stopped, lost
        its channel or never began is killed (the main loop refills its place); one that said it
        left its old world waits for its peers as long as it takes: membership is the daemon's to
        change, not ours."""
        connected = self.channels.connected()
        spare_streams = self.channels.spares()
        with self._lock:
            current = self._state.round.number if self._state.round is not None else None
            stuck_joining = any(p.joining and p.round == current and now - p.sent > JOIN_PROBE_AFTER
                                for p in self._state.pending.values())
        if stuck_joining:
            # The members it waits for may sit behind a cut link (a node admitted as its link
            # went down), which nothing else sees before their leases expire: check the ring.
            self._check_ring_once()
        with self._lock:
            expired = [(pid, p) for pid, p in self._state.pending.items() if now > p.deadline]
            group = self._state.group
            for pid, p in expired:
                w = group.worker(p.local_rank) if group is not None else None
                if w is None or w.pid != pid or not w.running:
                    del self._state.pending[pid]
                    continue  # gone already: its exit was reported as such
                linked = connected.get(w.local_rank) == pid or pid in spare_streams
                warming = p.warming and now - p.sent < WARMING_PATIENCE * self.config.reform_timeout
                overdue = overdue_reform(self._proc_state(p.local_rank, pid), linked, now - p.sent, p.joining, warming)
                extra = {"node": self.config.node_id, "rank": p.rank, "round": p.round}
                if not overdue.kill:
                    self._state.pending[pid] = dataclasses.replace(p, deadline=now + self.config.reform_timeout)
                    log.warning("agent %s: rank %d (pid %d) into round %d: %s", self.config.node_id, p.rank, pid,
                                p.round, overdue.why, extra=extra)
                    continue
                del self._state.pending[pid]
                self.stalls.forget(w.rank)
                log.error("agent %s: rank %d (pid %d) into round %d: %s; killing and replacing it",
                          self.config.node_id, p.rank, pid, p.round, overdue.why, extra=extra)
                self.metrics.reforms.labels(self.config.node_id, "timed-out").inc()
                w.dump_then_kill()  # its log says where it was stuck
                self._commands.put(("refill", (p.round, p.local_rank, pid)))


def _proc_state(pid: int) -> ProcState:
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return ProcState.EXITED
    if status == psutil.STATUS_STOPPED:
        return ProcState.STOPPED
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return ProcState.EXITED
    return ProcState.RUNNING
