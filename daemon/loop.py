"""The daemon process: leader election, then the loop that feeds the round machine from etcd.

Protocol, in order:

1. Grant a lease (``lease_ttl``) and campaign on ``JobKeys.leader`` with a ``LeaderRecord``.
   Standbys wait in the campaign; the leader key goes away with the leader's lease.
2. As leader: read the job prefix once, rebuild the machine with ``RoundMachine.resume`` (plus
   the fault history and quarantines of the previous leader) and feed it what etcd holds.
3. Open ONE prefix watch on the job at the read's revision + 1; feed each watch response (and
   what arrives within ``batch_window`` after it) to ``handle_batch``, a ``Tick`` when nothing
   arrives for ``tick_interval``.
4. Write each decision with ``Election.guarded_txn``: an ``OpenRound`` as the round record, also
   comparing the round key's mod revision with the one this leader last read or wrote, so two
   leaders can never write two records for one round number; a ``CloseRound`` marks the same
   record closed; a ``Status`` goes to the status key, rate-limited. Fault histories that
   changed are written before the decisions of their batch.
5. Housekeeping, so that a job can write for months: every ``compact_interval`` compact etcd's
   history up to the revision this leader had seen one interval before; keep the newest
   ``keep_ckpt_records`` checkpoint commit records and delete the older ones (guarded writes).
6. On any doubt (lease lost, ``NotLeader``, a round write that lost its compare, etcd gone,
   compacted watch history) stop deciding at once, drop the machine and go back to 1; the
   next term re-reads everything, so no decision is made twice and no round number is skipped.

Liveness of a node is its node key bound to its agent's lease: a DELETE is a lost lease.
"""

from __future__ import annotations

import bisect
import logging
import socket
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from stalwart.coord.client import EtcdClient, TxnResult
from stalwart.coord.election import Election, Leadership
from stalwart.coord.errors import CoordError, EtcdTimeout, LeaseLost, NotLeader
from stalwart.coord.keys import JobKeys, Kind
from stalwart.coord.lease import Lease
from stalwart.coord.reach import tcp_probe
from stalwart.coord.txn import Delete, Get, Op, Put, absent, mod_revision_is
from stalwart.coord.watch import EventType, Watch, WatchEvent
from stalwart.daemon import codec
from stalwart.daemon.config import DaemonConfig
from stalwart.daemon.errors import DaemonError
from stalwart.daemon.feed import Feed
from stalwart.daemon.goodput import GoodputTracker, fault_kind
from stalwart.daemon.hooks import QuarantineHook
from stalwart.daemon.nodes import NodeState
from stalwart.daemon.observe import HealthService, Metrics, SystemdNotifier
from stalwart.daemon.round_events import (
    CheckpointCommitted,
    CloseRound,
    Decision,
    Drain,
    Event,
    Health,
    HealthVerdict,
    OpenRound,
    ProgressReport,
    Status,
    Tick,
)
from stalwart.daemon.round_events import (
    LeaseLost as NodeLeaseLost,
)
from stalwart.daemon.rounds import RoundMachine
from stalwart.daemon.stragglers import ExclusionPlan, StragglerDetector, StragglerPolicy, Verdict
from stalwart.proto import records_pb2

__all__ = ["Daemon", "RoundConflict"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_MAX_BATCH = 200_000
_TXN_OPS = 100  # etcd refuses transactions of more than 128 operations by default
GOODPUT_INTERVAL = 10.0  # seconds between two writes of the job's goodput into the status record


class RoundConflict(DaemonError):
    """The round key changed under this leader (its compare failed while leadership held):
    someone else wrote a round. The leader re-reads the job before deciding again."""


class _StepDown(Exception):
    """Internal: stop deciding in this term (the reason is logged where it is raised)."""


@dataclass
class _Term:
    """One term of leadership: the machine and what the writes compare against."""

    leadership: Leadership
    lease: Lease
    machine: RoundMachine
    feed: Feed
    round_revision: int
    round_value: bytes
    watch_from: int = 0
    fault_seen_at: float | None = None
    pending_status: str | None = None
    status_written_at: float = -float("inf")
    scanned_at: float = -float("inf")
    last_status: str = ""  # the reason last written (rewritten when the stragglers change)
    stragglers: StragglerDetector = field(default_factory=StragglerDetector)
    straggling: tuple[Verdict, ...] = ()
    exclusion: ExclusionPlan = field(default_factory=ExclusionPlan)
    excluded: dict[str, records_pb2.Straggler] = field(default_factory=dict)
    ckpt_steps: list[int] = field(default_factory=list)  # sorted: the commit records in etcd
    compact_mark: tuple[float, int] | None = None  # (when, revision): compacted to one interval later
    goodput: GoodputTracker = field(default_factory=GoodputTracker)  # fed with wall time
    peak_workers: int = 0


class Daemon:
    """One rendezvous daemon of one job. Run it with :meth:`run`; set ``stop`` to end it.

    Collaborators are passed in; :meth:`from_config` builds the real ones (etcd client, metrics
    server, gRPC health service, systemd notifier). ``clock`` is monotonic seconds (the machine's
    ``now``), ``wall`` unix seconds (written into records).
    """

    def __init__(self, config: DaemonConfig, client: EtcdClient, *, metrics: Metrics | None = None,
                 notifier: SystemdNotifier | None = None, health: HealthService | None = None,
                 hook: QuarantineHook | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.settings = config.daemon
        self.client = client
        self.keys = JobKeys(config.daemon.job)
        self.election = Election(client, self.keys.leader)
        self.metrics = metrics or Metrics()
        self.notifier = notifier or SystemdNotifier({})
        self.health = health
        self.hook = hook or QuarantineHook((), config.daemon.job, config.daemon.hook_timeout)
        self._clock, self._wall = clock, wall
        self._term: _Term | None = None
        self.round_number = 0  # newest round this daemon knows of (for log context)

    @classmethod
    def from_config(cls, config: DaemonConfig) -> Daemon:
        """The real collaborators. Raises ``OSError`` when a port cannot be bound."""
        s = config.daemon
        metrics = Metrics()
        if s.metrics_port:
            metrics.serve(s.metrics_host, s.metrics_port)
        health = HealthService(s.health_host, s.health_port) if s.health_port else None
        hook = QuarantineHook(s.on_quarantine, s.job, s.hook_timeout,
                              on_done=lambda outcome: metrics.hook_runs.labels(outcome).inc())
        return cls(config, EtcdClient(config.etcd), metrics=metrics, notifier=SystemdNotifier(), health=health,
                   hook=hook)

    def close(self) -> None:
        """Stop serving health checks and close the etcd client (after :meth:`run` returned)."""
        if self.health is not None:
            self.health.stop()
        self.notifier.close()
        self.hook.close()
        self.client.close()

    @property
    def leading(self) -> bool:
        return self._term is not None

    # --- election -------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Campaign and lead until ``stop`` is set; then give up the lease so a standby takes over
        at once. Never raises for etcd trouble: it waits and tries again."""
        ready = False
        while not stop.is_set():
            try:
                lease = self._timed("lease_grant", lambda: Lease(self.client, self.settings.lease_ttl))
            except CoordError as exc:
                log.warning("daemon %s: cannot get a lease from etcd (%s); retrying", self.settings.daemon_id, exc)
                self.notifier.watchdog()
                stop.wait(1.0)
                continue
            if not ready:
                ready = True
                self.notifier.ready("standby")
            try:
                self._campaign(lease, stop)
            finally:
                lease.revoke()  # deletes the leader key, if ours: a standby takes over now
        self.notifier.stopping()

    def _campaign(self, lease: Lease, stop: threading.Event) -> None:
        host = socket.getfqdn()
        address = f"{host}:{self.settings.metrics_port}" if self.settings.metrics_port else host
        value = codec.encode_leader(self.settings.daemon_id, address, self._wall())  # fixed for this lease
        slice_s = max(1.0, self.settings.tick_interval)
        while not stop.is_set() and not lease.lost.is_set():
            self.notifier.watchdog()
            try:
                leadership = self.election.campaign(lease, value, timeout=slice_s)
            except EtcdTimeout:
                continue  # someone else leads: keep waiting
            except LeaseLost:
                return
            except CoordError as exc:
                log.warning("daemon %s: campaign failed (%s); retrying", self.settings.daemon_id, exc)
                stop.wait(0.5)
                continue
            try:
                self._lead(leadership, lease, stop)
            except _StepDown:
                stop.wait(0.2)

    # --- leading --------------------------------------------------------------------------------

    def _lead(self, leadership: Leadership, lease: Lease, stop: threading.Event) -> None:
        s = self.settings
        log.info("daemon %s: leading job %s (term %d)", s.daemon_id, s.job, leadership.term,
                 extra={"round": self.round_number})
        self.metrics.terms.inc()
        self.metrics.leader.set(1)
        if self.health is not None:
            self.health.set_leader(True)
        self.notifier.status(f"leader of job {s.job}")
        try:
            term = self._take_over(leadership, lease)
            self._term = term
            with Watch(self.client, self.keys.prefix, term.watch_from) as watch:
                while not stop.is_set():
                    self._check_lease(term)
                    batch, arrived = self._collect(watch)
                    now = self._clock()
                    events: list[Event] = []
                    if batch:
                        events = term.feed.convert(batch)
                        self._note_faults(term, events, arrived)
                        self._observe(term, events)
                        self.metrics.events.inc(len(events))
                        decisions = term.machine.handle_batch(events, now)
                    else:
                        decisions = term.machine.handle(Tick(), now)
                    self._apply(term, decisions, now)
                    self._check_stragglers(term, events, now)
                    self._note_ckpts(term, batch)
                    self._housekeeping(term, now, watch.next_revision - 1)
        except (NotLeader, LeaseLost, RoundConflict) as exc:
            log.warning("daemon %s: stopped deciding: %s", s.daemon_id, exc, extra={"round": self.round_number})
            raise _StepDown from exc
        except CoordError as exc:
            log.error("daemon %s: etcd failed while leading (%s); re-reading the job", s.daemon_id, exc,
                      extra={"round": self.round_number})
            raise _StepDown from exc
        finally:
            self._term = None
            self.metrics.leader.set(0)
            if self.health is not None:
                self.health.set_leader(False)
            self.notifier.status("standby")

    def _take_over(self, leadership: Leadership, lease: Lease) -> _Term:
        """Steps 2 of the protocol: one read of the job, a resumed machine, its first decisions."""
        kvs, revision = self._timed("get_prefix", lambda: self.client.get_prefix(self.keys.prefix))
        feed = Feed(self.keys, on_ignored=lambda kind, why: self.metrics.ignored.labels(kind).inc(),
                    host_probe=host_answers, agent_probe=agent_answers)
        snap = feed.snapshot(kvs, revision)
        now, wall = self._clock(), self._wall()
        number = snap.round.number if snap.round else 0
        current = snap.round.current if snap.round else None
        machine = RoundMachine.resume(self.config.policy, current, number, snap.committed_step, now,
                                      gave_up=snap.round.gave_up if snap.round else "")
        for f in snap.faults:
            machine.restore_node(f.node_id, [wall - t for t in f.fault_times], f.quarantined)
        term = _Term(leadership, lease, machine, feed, snap.round_revision, snap.round_value, revision + 1)
        term.ckpt_steps = sorted(p.step for p in map(self.keys.parse, (kv.key for kv in kvs))
                                 if p is not None and p.kind is Kind.CKPT)
        term.compact_mark = (now, revision)
        status_kv = next((kv for kv in kvs if kv.key == self.keys.status), None)
        carried = codec.decode_goodput(status_kv.value) if status_kv is not None else None
        if carried is not None:
            term.goodput.resume(carried.productive_seconds, carried.elapsed_seconds, carried.step, wall)
        pol = self.config.policy
        term.stragglers = StragglerDetector(StragglerPolicy(pol.straggler_factor, pol.straggler_steps))
        term.stragglers.reset(feed.members)
        self.round_number = number
        self.metrics.round.set(number)
        self._set_world(current)
        log.info("daemon %s: took over at revision %d: %d node keys, round %d (%s), newest checkpoint %s",
                 self.settings.daemon_id, revision, len(feed.registered), number,
                 "open" if current else "none open", snap.committed_step, extra={"round": number})
        self._apply(term, machine.handle_batch(snap.events, now), now)
        return term

    def _collect(self, watch: Watch) -> tuple[list[WatchEvent], float]:
        """The next watch response, and whatever follows within ``batch_window``."""
        first = watch.get(timeout=self.settings.tick_interval)
        arrived = self._clock()
        if not first:
            return [], arrived
        batch = list(first)
        deadline = arrived + self.settings.batch_window
        while len(batch) < _MAX_BATCH:
            left = deadline - self._clock()
            more = watch.get(timeout=left) if left > 0 else watch.get(timeout=0)
            if not more:
                break
            batch += more
        return batch, arrived

    def _check_lease(self, term: _Term) -> None:
        if term.lease.lost.is_set():
            raise LeaseLost(f"leader lease lost: {term.lease.lost_reason}")

    def _note_faults(self, term: _Term, events: list[Event], arrived: float) -> None:
        if term.fault_seen_at is not None or not term.feed.members:
            return
        for ev in events:
            if isinstance(ev, (NodeLeaseLost, Drain)) or (
                    isinstance(ev, HealthVerdict) and ev.health is Health.FATAL):
                if ev.node_id in term.feed.members:
                    term.fault_seen_at = arrived
                    return

    # --- writing decisions ----------------------------------------------------------------------

    def _apply(self, term: _Term, decisions: list[Decision], now: float) -> None:
        # Fault histories first: a leader killed between the two writes leaves a successor that
        # knows every quarantine the written round was decided with.
        self._persist_faults(term, now)
        for d in decisions:
            if isinstance(d, OpenRound):
                self._write_round(term, codec.encode_round(d, term.feed.agent_addresses,
                                                           self.settings.daemon_id, self._wall()), d.number)
                term.feed.members = frozenset(m.node_id for m in d.members)
                term.goodput.round_opened(self._wall())
                self._note_world(term, sum(m.devices for m in d.members))
                term.feed.round_number = d.number
                term.feed.forget_old_rounds()
                term.stragglers.reset(term.feed.members)
                self._set_world(d)
                self._decided(term, "open", d.number)
                log.info("round %d: opened with %d nodes (%d workers), restore step %s: %s", d.number,
                         d.world_size, sum(m.devices for m in d.members), d.restore_step, d.reason,
                         extra={"round": d.number})
                term.pending_status = ""
            elif isinstance(d, CloseRound):
                value = codec.encode_closed(term.round_value, d, self.settings.daemon_id, self._wall())
                self._write_round(term, value, d.number)
                term.feed.members = frozenset()
                self._note_world(term, 0)
                term.stragglers.reset(())
                self._set_world(None)
                self._decided(term, "close", d.number)
                log.warning("round %d: closed: %s", d.number, d.reason, extra={"round": d.number})
            elif isinstance(d, Status):
                self.metrics.decisions.labels("status").inc()
                term.pending_status = d.reason
        self._flush_status(term, now)

    def _write_round(self, term: _Term, value: bytes, number: int) -> None:
        key = self.keys.round
        guard = mod_revision_is(key, term.round_revision) if term.round_revision else absent(key)
        res = self._guarded(term, [guard], [Put(key, value)], [Get(key)], "round_txn")
        if res.succeeded:
            term.round_revision = res.revision
        else:
            stored = res.gets[1][0] if len(res.gets) > 1 and res.gets[1] else None
            if res.attempts > 1 and stored is not None and stored.value == value:
                term.round_revision = stored.mod_revision  # our first try landed; its answer was lost
            else:
                raise RoundConflict(f"round key changed under this leader while writing round {number}")
        term.round_value = value
        self.round_number = number
        self.metrics.round.set(number)

    def _guarded(self, term: _Term, compares: list, success: list[Op], failure: list[Op], op: str) -> TxnResult:
        self._check_lease(term)
        return self._timed(op, lambda: self.election.guarded_txn(term.leadership, compares, success, failure))

    def _decided(self, term: _Term, kind: str, number: int) -> None:
        self.metrics.decisions.labels(kind).inc()
        if term.fault_seen_at is not None:
            self.metrics.fault_to_round.observe(self._clock() - term.fault_seen_at)
            term.fault_seen_at = None

    def _flush_status(self, term: _Term, now: float, force: bool = False) -> None:
        if term.pending_status is None:
            return
        if not force and now - term.status_written_at < self.settings.status_interval:
            return
        reason = term.pending_status
        value = codec.encode_status(reason, self.round_number, self.settings.daemon_id, self._wall(),
                                    self._straggler_records(term), self._goodput_record(term))
        self._guarded(term, [], [Put(self.keys.status, value)], [], "status_txn")
        changed = reason != term.last_status
        term.pending_status, term.status_written_at, term.last_status = None, now, reason
        term.goodput.new_costs = 0
        if reason and changed:
            log.info("status: %s", reason, extra={"round": self.round_number})
        self.notifier.status(f"leader: {reason}" if reason else f"leader: round {self.round_number} open")

    def _persist_faults(self, term: _Term, now: float) -> None:
        """Write the fault history of nodes whose faults or quarantine changed (a few per fault)."""
        st = term.machine.state
        if not st.fault_changes:
            return
        changed, st.fault_changes = sorted(st.fault_changes), set()
        wall = self._wall()
        ops: list[Op] = []
        newly: list[tuple[str, str]] = []
        for node_id in changed:
            rec = st.nodes.get(node_id)
            if rec is None:
                continue
            quarantined = rec.state is NodeState.QUARANTINED
            key = self.keys.faults(node_id)
            if quarantined and node_id not in term.feed.quarantined:
                newly.append((node_id, f"stalwart job {self.settings.job}: quarantined after {len(rec.faults)} "
                                       f"faults within {self.config.policy.quarantine_window:g}s"))
            if quarantined:
                term.feed.quarantined.add(node_id)
            else:
                term.feed.quarantined.discard(node_id)
            if not rec.faults and not quarantined:
                ops.append(Delete(key))
                continue
            times = [wall - (now - t) for t in rec.faults]
            ops.append(Put(key, codec.encode_faults(node_id, times, quarantined, "", self.settings.daemon_id)))
            if quarantined:
                log.warning("node %s: quarantined after %d faults", node_id, len(rec.faults),
                            extra={"round": self.round_number, "node": node_id})
        for i in range(0, len(ops), _TXN_OPS):
            self._guarded(term, [], ops[i:i + _TXN_OPS], [], "faults_txn")
        for node_id, reason in newly:  # persisted first: the scheduler never drains a node etcd does not hold
            self.metrics.quarantines.inc()
            self.hook.quarantined(node_id, reason)

    # --- goodput --------------------------------------------------------------------------------

    def _observe(self, term: _Term, events: list[Event]) -> None:
        """Feed the goodput tracker and the job-level metrics (wall time: it is carried to the next
        leader and shown to people)."""
        wall, g = self._wall(), term.goodput
        for ev in events:
            kind = fault_kind(ev, term.feed.members)
            if kind is not None:
                self.metrics.member_faults.labels(kind).inc()
                g.fault(getattr(ev, "node_id", ""), kind, wall)
            elif isinstance(ev, ProgressReport) and ev.node_id in term.feed.members:
                before = g.step
                g.progress(ev.step, wall)
                if g.step > before:
                    self.metrics.progress_time.set(wall)
            elif isinstance(ev, CheckpointCommitted):
                self.metrics.ckpt_step.set(ev.step)
                self.metrics.ckpt_time.set(wall)
        for f in g.faults:
            if f.cost is not None and not f.observed:
                self.metrics.fault_cost.observe(f.cost)
                f.observed = True
        summary = g.summary(wall)
        self.metrics.productive.set(summary.productive)
        self.metrics.elapsed.set(summary.elapsed)
        if summary.ratio is not None:
            self.metrics.goodput.set(summary.ratio)
        self.metrics.job_step.set(max(summary.step, 0))
        if summary.step_time is not None:
            self.metrics.step_time.set(summary.step_time)
        self._goodput_due(term)

    def _goodput_due(self, term: _Term) -> None:
        """Rewrite the status record with the new totals every GOODPUT_INTERVAL, and at once when a
        fault's cost became known. Checked on quiet ticks too: the last step before a job goes
        quiet (a stall, the end) would stay unwritten until the next event otherwise."""
        g = term.goodput
        due = self._clock() - term.status_written_at >= GOODPUT_INTERVAL or g.new_costs
        if due and term.pending_status is None and g.started_at is not None:
            term.pending_status = term.last_status

    def _goodput_record(self, term: _Term) -> records_pb2.JobGoodput:
        s = term.goodput.summary(self._wall())
        return records_pb2.JobGoodput(
            productive_seconds=s.productive, elapsed_seconds=s.elapsed, step=s.step, step_time=s.step_time or 0.0,
            faults=[records_pb2.FaultCostRecord(node_id=f.node, kind=f.kind, at=f.at, step=f.step,
                                                cost=f.cost or 0.0, known=f.cost is not None) for f in s.faults])

    def _note_world(self, term: _Term, workers: int) -> None:
        term.peak_workers = max(term.peak_workers, workers)
        self.metrics.lost_throughput.set(1.0 - workers / term.peak_workers if term.peak_workers else 0.0)

    # --- stragglers -----------------------------------------------------------------------------

    def _check_stragglers(self, term: _Term, events: list[Event], now: float) -> None:
        """Feed members' busy times to the detector; report changes; with ``exclude_stragglers``,
        hold a straggler out (a drain hold) once the next checkpoint has committed."""
        for ev in events:
            if isinstance(ev, ProgressReport):
                term.stragglers.report(ev.node_id, ev.step, ev.busy_time)
        found = tuple(term.stragglers.stragglers())
        names = {v.node_id for v in found}
        if names != {v.node_id for v in term.straggling}:
            for v in found:
                if v.node_id not in {s.node_id for s in term.straggling}:
                    log.warning("node %s: straggler: busy %.3f s/step vs %.3f s median of the others "
                                "(%d reports in a row, since step %d)", v.node_id, v.busy_time, v.others_median,
                                v.consecutive, v.since_step,
                                extra={"node": v.node_id, "round": self.round_number, "step": v.since_step})
            for old in term.straggling:
                if old.node_id not in names:
                    log.info("node %s: no longer a straggler", old.node_id,
                             extra={"node": old.node_id, "round": self.round_number})
                    self.metrics.straggler.labels(old.node_id).set(0)
            if term.pending_status is None:
                term.pending_status = term.last_status  # rewrite the status record with the new list
        term.straggling = found
        for v in found:
            self.metrics.straggler.labels(v.node_id).set(1)
            self.metrics.busy.labels(v.node_id).set(v.busy_time)
        if not self.config.policy.exclude_stragglers:
            return
        for node_id in list(term.exclusion.waiting):
            if node_id not in names:
                term.exclusion.recovered(node_id)
        for v in found:
            if term.exclusion.found(v.node_id, term.machine.state.committed_step):
                log.warning("node %s: straggler will leave the world at the next checkpoint", v.node_id,
                            extra={"node": v.node_id, "round": self.round_number})
        for ev in events:
            if isinstance(ev, CheckpointCommitted):
                for node_id in term.exclusion.committed(ev.step):
                    self._exclude(term, node_id, ev.step, found)

    def _exclude(self, term: _Term, node_id: str, step: int, found: tuple[Verdict, ...]) -> None:
        st, pol = term.machine.state, self.config.policy
        members = st.round.members if st.round is not None else ()
        if node_id not in members:
            return
        if pol.world_size_for(len(members) - 1 + len(st.waiting)) is None:
            log.warning("node %s: straggler kept: too few nodes without it", node_id,
                        extra={"node": node_id, "round": self.round_number})
            term.exclusion.excluded.discard(node_id)
            return
        v = next((v for v in found if v.node_id == node_id), None)
        detail = (f"straggler: busy {v.busy_time:.3f} s/step vs {v.others_median:.3f} s median of the others"
                  if v else "straggler")
        reason = f"{detail}; excluded at the checkpoint of step {step}"
        value = codec.encode_cordon(node_id, codec.Hold.DRAIN, reason, f"daemon {self.settings.daemon_id}",
                                    self._wall())
        self._guarded(term, [], [Put(self.keys.cordon(node_id), value)], [], "cordon_txn")
        self.metrics.decisions.labels("exclude-straggler").inc()
        term.excluded[node_id] = records_pb2.Straggler(
            node_id=node_id, busy_time=v.busy_time if v else 0.0, others_median=v.others_median if v else 0.0,
            consecutive=v.consecutive if v else 0, excluded=True, since_step=v.since_step if v else 0)
        log.warning("node %s: %s", node_id, reason, extra={"node": node_id, "round": self.round_number, "step": step})

    def _straggler_records(self, term: _Term) -> list[records_pb2.Straggler]:
        out = {node_id: rec for node_id, rec in term.excluded.items() if node_id in term.feed.holds}
        for v in term.straggling:
            out.setdefault(v.node_id, records_pb2.Straggler(
                node_id=v.node_id, busy_time=v.busy_time, others_median=v.others_median, consecutive=v.consecutive,
                excluded=v.node_id in term.exclusion.waiting, since_step=v.since_step))
        return [out[k] for k in sorted(out)]

    # --- bookkeeping ----------------------------------------------------------------------------

    def _note_ckpts(self, term: _Term, batch: list[WatchEvent]) -> None:
        """Remember the commit records written (also the undecodable ones: they are pruned too)."""
        prefix = self.keys.ckpt_prefix
        for ev in batch:
            if ev.type is EventType.PUT and ev.key.startswith(prefix):
                parsed = self.keys.parse(ev.key)
                if parsed is not None and parsed.kind is Kind.CKPT:
                    i = bisect.bisect_left(term.ckpt_steps, parsed.step)
                    if i == len(term.ckpt_steps) or term.ckpt_steps[i] != parsed.step:
                        term.ckpt_steps.insert(i, parsed.step)

    def _prune_ckpts(self, term: _Term) -> None:
        keep = self.settings.keep_ckpt_records
        if not keep or len(term.ckpt_steps) <= keep:
            return
        old, term.ckpt_steps = term.ckpt_steps[:-keep], term.ckpt_steps[-keep:]
        ops: list[Op] = [Delete(self.keys.ckpt(step)) for step in old]
        for i in range(0, len(ops), _TXN_OPS):
            self._guarded(term, [], ops[i:i + _TXN_OPS], [], "prune_txn")
        self.metrics.pruned.inc(len(old))
        log.info("pruned %d checkpoint records (steps %d..%d); %d kept", len(old), old[0], old[-1], keep,
                 extra={"round": self.round_number})

    def _compact(self, term: _Term, now: float, revision: int) -> None:
        """Compact to the revision seen one interval ago: watchers (agents, a standby that just
        read the job) that lag by less than an interval resume without re-reading."""
        interval = self.settings.compact_interval
        mark = term.compact_mark
        if not interval or mark is None or now - mark[0] < interval:
            return
        term.compact_mark = (now, revision)
        if mark[1] <= 0:
            return
        self._timed("compact", lambda: self.client.compact(mark[1], physical=False))
        self.metrics.compacted.set(mark[1])
        log.debug("compacted etcd history up to revision %d", mark[1], extra={"round": self.round_number})

    def _housekeeping(self, term: _Term, now: float, revision: int) -> None:
        self.notifier.watchdog()
        self._goodput_due(term)
        self._flush_status(term, now)
        self._prune_ckpts(term)
        self._compact(term, now, revision)
        if now - term.scanned_at >= self.settings.tick_interval:
            term.scanned_at = now
            if term.machine.expire_faults(now):
                self._persist_faults(term, now)
            counts = Tally(rec.state.value for rec in term.machine.state.nodes.values())
            for state in NodeState:
                self.metrics.nodes.labels(state.value).set(counts.get(state.value, 0))

    def _set_world(self, rnd: OpenRound | None) -> None:
        self.metrics.world_nodes.set(len(rnd.members) if rnd else 0)
        self.metrics.world_workers.set(sum(m.devices for m in rnd.members) if rnd else 0)

    def _timed(self, op: str, fn: Callable[[], T]) -> T:
        with self.metrics.etcd_latency.labels(op).time():
            return fn()


def agent_answers(address: str, timeout: float = 0.3) -> bool:
    """Whether an agent's ``host:port`` accepts a TCP connection (refused or no answer: gone)."""
    return tcp_probe(address, timeout) == "accepted"


def host_answers(address: str, timeout: float = 0.3) -> bool:
    """Whether the host of an agent's ``host:port`` still answers: a connection accepted or
    refused (the agent is gone, the host is up) says yes; a timeout or an unreachable network
    says no (the host or its link is down)."""
    return tcp_probe(address, timeout) != "none"
