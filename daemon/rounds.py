"""The rendezvous daemon's pure round logic: events in, decisions out, no I/O and no clock.

The loop around it reads etcd and the clock, and calls ``RoundMachine.handle_batch(events, now)``
with each watch response (``handle(event, now)`` for one event, a :class:`Tick` every second or so);
it writes each returned decision, in order. ``now`` is the
loop's monotonic clock in seconds; a value older than the newest seen is treated as the newest.

Rules, in the order the machine applies them:

- **First round**: opens once the largest feasible world is registered and healthy, or
  ``join_timeout`` after the first registration with whatever feasible world is there.
- **Shrink**: a member's lease is lost, its health turns FATAL, it is drained or quarantined, or it
  alone stops making progress for ``stall_timeout`` -> a new round at once, from the surviving
  members and any healthy waiting nodes, if a feasible world remains; otherwise the round closes
  and a :class:`Status` says what it is waiting for.
- **Replacing a lost worker**: a member whose worker died with no warm spare to take its rank
  (its agent says it is replacing) is left out of the new round when a feasible world remains
  without it (``shrink_to_replace``), so the others re-form in place at once instead of waiting
  for a new process to start; it is not taken into a round until its agent says the replacement
  is warm, and then comes back by the regrow rule.
- **Lost by its peers**: a strict majority of the other members (two at least; one, where the
  daemon's own probe finds the member's agent gone) report that their workers'
  collectives broke on a member whose agent does not answer a ping -> a new round without it at
  once, as for a lost lease, seconds before the lease expires. It stays out of new rounds for
  ``LOST_BY_PEERS_HOLD`` unless it registers again.
- **Network stall**: no member made progress for ``stall_timeout`` -> the member that a strict
  majority of the other members report unreachable is excluded and a new round opens; when no
  single member qualifies, the same members (those still eligible) are reopened as a new round.
- **Regrow**: healthy waiting nodes join when the world can grow (after quantum and ``max_nodes``),
  ``regrow_cooldown`` has passed since the round opened, and either a checkpoint newer than the
  round's restore step commits or the round has not reported any training progress yet.
- **Quarantine**: a fault is a healthy node turning unhealthy (TRANSIENT or FATAL), losing its
  lease, or being excluded for a stall. ``quarantine_faults`` of them within ``quarantine_window``
  hold the node out until :class:`Uncordon`.
- **Restore step**: every round restores the newest committed checkpoint (None before the first).

Rank order: the surviving members of the previous round keep their relative order, then the
newcomers follow sorted by node id; when the quantum or ``max_nodes`` leaves no room for all,
the list is cut from the end (the highest ranks leave first). A round that opens while none is
open (the first one, or after a wait below ``min_nodes``) is sorted by node id.

Unknown node ids, duplicate registrations, events about nodes outside the world and malformed
events are logged and ignored: ``handle`` never raises for an event's content.

Cost: a registration, health verdict or progress report is O(1); opening a round is
O(n log n) in the number of nodes; so is the occasional scan for a single stalled member. Events
handled in one batch change the world at most once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from stalwart.daemon.nodes import HELD, NodeRecord, NodeState, check_transition
from stalwart.daemon.policy import RoundPolicy
from stalwart.daemon.round_events import (
    CheckpointCommitted,
    CloseRound,
    Cordon,
    Decision,
    Drain,
    Event,
    Health,
    HealthVerdict,
    JobGaveUp,
    LeaseLost,
    Member,
    NodeRegistered,
    OpenRound,
    PeerReachability,
    PeersLost,
    ProgressReport,
    Replacing,
    Status,
    Uncordon,
    WorkerFailed,
    malformed,
)

__all__ = ["MachineState", "RoundMachine", "RoundRecord", "name_unreachable_node"]

log = logging.getLogger(__name__)

@dataclass
class RoundRecord:
    """The open round. ``members`` are node ids in rank order.

    ``last_progress_at`` is the newest progress of any member (the opening time before the first);
    ``stall_check_at`` is a time before which no member can have stalled, so the machine scans
    members for a single stall only after it. ``last_commit_at``: the newest checkpoint commit in
    the round (its opening before the first).
    """

    number: int
    members: tuple[str, ...]
    opened_at: float
    restore_step: int | None
    training: bool = False
    last_progress_at: float = 0.0
    stall_check_at: float = 0.0
    last_commit_at: float = 0.0
    member_set: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.member_set = frozenset(self.members)


@dataclass
class MachineState:
    """Everything the round machine knows; plain data, mutated only by :class:`RoundMachine`.

    ``waiting`` indexes the eligible nodes outside the world (state WAITING, registered,
    HEALTHY) so that counting them is O(1). ``fault_changes`` names the nodes whose fault times or
    quarantine changed; the loop persists those and empties the set, so that a standby leader
    inherits them (:meth:`RoundMachine.restore_node`). ``last_round_number`` is the number of the newest
    round ever opened (0: none yet); a new round is always numbered one above it.
    """

    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)
    round: RoundRecord | None = None
    last_round_number: int = 0
    first_registered_at: float | None = None
    committed_step: int | None = None
    last_status: str | None = None
    now: float = -math.inf
    fault_changes: set[str] = field(default_factory=set)
    gave_up: str = ""  # the job gave up (why): no round opens again (a new daemon term keeps it)


def name_unreachable_node(members: Sequence[str], reports: Mapping[str, Iterable[str]]) -> str | None:
    """The single member that the others cannot reach, or None when there is no such member.

    ``reports`` maps a member to the peers it reports unreachable. A member qualifies when a strict
    majority of the *other* members report it unreachable; the answer is that member if exactly
    one qualifies. Two nodes that each report the other name nobody: which side is broken cannot
    be told. Reports from non-members and about non-members are not counted.
    """
    member_set = set(members)
    accusers: dict[str, int] = {}
    for reporter in members:
        for peer in set(reports.get(reporter, ())):
            if peer in member_set and peer != reporter:
                accusers[peer] = accusers.get(peer, 0) + 1
    others = len(member_set) - 1
    qualified = [peer for peer, count in accusers.items() if 2 * count > others]
    return qualified[0] if len(qualified) == 1 else None


class RoundMachine:
    """Decides, event by event, which nodes form each round. Not thread-safe: one caller.

    ``handle`` returns the decisions the event causes (usually none); at most one of them opens
    or closes a round. The state is :attr:`state`, a plain :class:`MachineState`.
    """

    def __init__(self, policy: RoundPolicy, state: MachineState | None = None) -> None:
        self.policy = policy
        self.state = state if state is not None else MachineState()
        # Collected while one batch is applied, acted on once at its end.
        self._broken: list[str] = []
        self._regrow_trigger: str | None = None
        # Members that restore_node held out: the next batch replaces the round without them.
        self._pending_broken: list[str] = []
        self._lost_reports: dict[int, dict[str, frozenset[str]]] = {}  # round -> member -> peers it lost
        self._lost_now: set[str] = set()  # members lost by their peers in this batch
        self._held_by_peers: dict[str, float] = {}  # node -> until when it stays out (lost by its peers)
        self._away: dict[str, float] = {}  # member -> when its agent went (host up): kept for a successor

    @classmethod
    def resume(cls, policy: RoundPolicy, current: OpenRound | None, last_round_number: int,
               committed_step: int | None, now: float, gave_up: str = "") -> RoundMachine:
        """Rebuild a machine where a previous leader left off (a standby taking over).

        ``current`` is the round record the previous leader wrote (None when its last word was
        "no round"), ``last_round_number`` the highest round number ever written, so the next round
        is numbered above both. Members of ``current`` start as registered, healthy members whose
        stall clock and cool-down restart at ``now``. Then feed, in one :meth:`handle_batch`, what
        etcd holds: every node record as :class:`NodeRegistered` (members' duplicates are ignored),
        a :class:`LeaseLost` for each member that has no node record, health verdicts, progress
        and commit records. Operator holds and fault counts are not in etcd and start empty.
        """
        machine = cls(policy)
        st = machine.state
        st.now = now
        st.gave_up = gave_up if current is None else ""
        st.committed_step = committed_step
        st.last_round_number = max(last_round_number, current.number if current else 0)
        if current is not None:
            members = tuple(m.node_id for m in current.members)
            for m in current.members:
                st.nodes[m.node_id] = NodeRecord(m.node_id, m.address, m.devices, state=NodeState.MEMBER)
            st.round = RoundRecord(current.number, members, now, current.restore_step, last_progress_at=now,
                                   stall_check_at=now + policy.stall_timeout, last_commit_at=now)
            st.first_registered_at = now
        log.info("round %d: resumed with %d members, newest checkpoint %s",
                 st.last_round_number, len(st.nodes), committed_step)
        return machine

    def restore_node(self, node_id: str, fault_ages: Sequence[float], quarantined: bool) -> None:
        """Put back a node's recent faults and quarantine as a previous leader persisted them.

        Call after :meth:`resume` and before the first :meth:`handle_batch`. ``fault_ages`` are
        seconds before ``state.now`` (ages outside the quarantine window are dropped). A node not
        known yet gets a record that waits for its registration (LOST, or QUARANTINED); a member
        of the resumed round that was quarantined leaves it at the next batch.
        """
        st, pol = self.state, self.policy
        if not isinstance(node_id, str) or not node_id:
            log.warning("round %d: ignored restore of node %r: not a node id", self._round_no(), node_id)
            return
        faults = sorted(st.now - age for age in fault_ages
                        if math.isfinite(age) and 0 <= age < pol.quarantine_window)
        rec = st.nodes.get(node_id)
        if rec is None:
            held = NodeState.QUARANTINED if quarantined else NodeState.LOST
            rec = st.nodes[node_id] = NodeRecord(node_id, "", 1, state=held, registered=False)
        rec.faults = faults
        if quarantined and rec.state is not NodeState.QUARANTINED:
            self._move(rec, NodeState.QUARANTINED, "quarantined before this leader took over")
            if self._in_round(node_id):
                self._pending_broken.append(f"node {node_id} is quarantined")
        st.fault_changes.discard(node_id)

    # --- entry point ----------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Decision]:
        """Apply ``event`` at time ``now`` and return the resulting decisions (often none).

        Never raises for an event's content; a non-finite ``now`` or a malformed event is logged
        and ignored. Time-based rules are checked on every call, not only on :class:`Tick`.
        """
        return self.handle_batch((event,), now)

    def handle_batch(self, events: Iterable[Event], now: float) -> list[Decision]:
        """Apply ``events`` in order, all at time ``now``, then decide once.

        Feed a whole etcd watch response at once: when 1 % of the nodes lose their leases together,
        the world changes once instead of once per node. At most one returned decision opens or
        closes a round. Never raises for an event's content (see :meth:`handle`).
        """
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            log.warning("round %d: ignored %r: time %r is not a finite number", self._round_no(), events, now)
            return []
        st = self.state
        st.now = now = max(float(now), st.now)
        self._broken, self._regrow_trigger = self._pending_broken, None
        self._pending_broken = []
        for event in events:
            problem = malformed(event)
            if problem is not None:
                log.warning("round %d: ignored malformed event %r: %s", self._round_no(), event, problem)
                continue
            self._dispatch(event, now)
        decisions: list[Decision] = []
        if st.gave_up and st.round is not None:
            decisions = self._close(st.round, st.gave_up)
        elif self._broken and st.round is not None:
            causes = self._broken
            why = "; ".join(causes[:3]) + (f"; and {len(causes) - 3} more" if len(causes) > 3 else "")
            decisions = self._reopen(now, why, exclude=set(self._lost_now))
        elif self._regrow_trigger is not None:
            decisions = self._regrow(now, self._regrow_trigger)
        self._lost_now = set()
        return decisions or self._evaluate(now)

    def _dispatch(self, event: Event, now: float) -> None:
        if isinstance(event, NodeRegistered):
            self._on_registered(event, now)
        elif isinstance(event, LeaseLost):
            self._on_lease_lost(event, now)
        elif isinstance(event, HealthVerdict):
            self._on_health(event, now)
        elif isinstance(event, ProgressReport):
            self._on_progress(event, now)
        elif isinstance(event, CheckpointCommitted):
            self._on_checkpoint(event)
        elif isinstance(event, Drain):
            self._on_drain(event)
        elif isinstance(event, Cordon):
            self._on_cordon(event)
        elif isinstance(event, Uncordon):
            self._on_uncordon(event)
        elif isinstance(event, PeersLost):
            self._on_peers_lost(event, now)
        elif isinstance(event, PeerReachability):
            self._on_reachability(event)
        elif isinstance(event, WorkerFailed):
            self._on_worker_failed(event, now)
        elif isinstance(event, JobGaveUp):
            self._on_gave_up(event)
        elif isinstance(event, Replacing):
            self._on_replacing(event)
        # Tick: nothing to apply; the time-based rules run after every batch

    # --- event handlers -------------------------------------------------------------------------

    def _on_registered(self, ev: NodeRegistered, now: float) -> None:
        st = self.state
        rec = st.nodes.get(ev.node_id)
        if rec is not None and rec.registered:
            log.info("round %d: node %s: ignored duplicate registration", self._round_no(), ev.node_id)
            return
        if st.first_registered_at is None:
            st.first_registered_at = now
        if rec is None:
            rec = NodeRecord(ev.node_id, ev.address, ev.devices)
            st.nodes[ev.node_id] = rec
            log.info("round %d: node %s: registered at %s with %d devices, waiting",
                     self._round_no(), ev.node_id, ev.address, ev.devices)
            self._sync(rec)
            return
        rec.address, rec.devices = ev.address, ev.devices
        if self._away.pop(ev.node_id, None) is not None and self._in_round(ev.node_id):
            rec.registered = True
            self._sync(rec)
            log.info("round %d: node %s: its agent is back; the round goes on", self._round_no(), ev.node_id)
            return
        rec.registered, rec.replacing, rec.lost_by_peers_until = True, False, None
        rec.health, rec.health_detail = Health.HEALTHY, ""
        if rec.state is NodeState.LOST:
            self._move(rec, NodeState.WAITING, "registered again")
        else:
            log.info("round %d: node %s: registered again, still %s",
                     self._round_no(), rec.node_id, rec.state.value)
            self._sync(rec)

    def _on_lease_lost(self, ev: LeaseLost, now: float) -> None:
        rec = self._known(ev.node_id, "lease lost")
        if rec is None:
            return
        if not rec.registered:
            log.info("round %d: node %s: ignored lease loss, not registered", self._round_no(), rec.node_id)
            return
        # A planned leave (the agent stopped on purpose) shrinks the world like a lost lease, but
        # is no fault: a rolling restart must not quarantine the nodes it restarts.
        rnd = self.state.round
        grace = self.policy.agent_restart_grace
        # A node whose peers' workers lost it is not only restarting its agent: no grace for it.
        reports = self._lost_reports.get(rnd.number, {}) if rnd is not None else {}
        accused = any(rec.node_id in lost for lost in reports.values())
        if ev.host_up and not ev.planned and grace > 0 and rnd is not None and rnd.training \
                and self._in_round(rec.node_id) and rec.state not in HELD and not accused:
            # Only the agent is gone: its workers may train on, and its successor adopts them.
            # Keep the node in the world (not eligible for a new one) while that can happen.
            rec.registered = False
            self._away[rec.node_id] = now
            self._sync(rec)
            log.warning("round %d: node %s: lease lost but its host answers: its agent is restarting; keeping it "
                        "in the world for up to %gs", rnd.number, rec.node_id, grace)
            return
        counts = rec.health is Health.HEALTHY and rec.state not in HELD and not ev.planned
        why = "left (its agent stopped)" if ev.planned else "lease lost"
        rec.registered = False
        if not (counts and self._fault(rec, now, why)) and rec.state not in HELD:
            self._move(rec, NodeState.LOST, why)
        self._sync(rec)
        if self._in_round(rec.node_id):
            self._broken.append(f"node {rec.node_id} {why}")

    def _on_health(self, ev: HealthVerdict, now: float) -> None:
        rec = self._known(ev.node_id, f"health {ev.health.value}")
        if rec is None:
            return
        before = rec.health
        rec.health, rec.health_detail = ev.health, ev.detail
        if before is ev.health:
            return
        why = f"health {before.value} -> {ev.health.value}" + (f" ({ev.detail})" if ev.detail else "")
        log.info("round %d: node %s: %s", self._round_no(), rec.node_id, why)
        if rec.registered and rec.state not in HELD:
            quarantined = before is Health.HEALTHY and self._fault(rec, now, why)
            if not quarantined:
                if ev.health is Health.FATAL:
                    self._move(rec, NodeState.UNHEALTHY, why)
                elif rec.state is NodeState.UNHEALTHY:
                    self._move(rec, NodeState.WAITING, why)
        self._sync(rec)
        if self._in_round(rec.node_id) and (
            rec.health is Health.FATAL or rec.state is NodeState.QUARANTINED
        ):
            self._broken.append(f"node {rec.node_id} {why}")

    def _on_worker_failed(self, ev: WorkerFailed, now: float) -> None:
        """Restart the round (the restart-everything path): its members stay, newcomers may join."""
        rec = self._known(ev.node_id, "worker failure")
        rnd = self.state.round
        if rec is None or rnd is None or ev.round != rnd.number or not self._in_round(rec.node_id):
            log.info("round %d: node %s: ignored worker failure of round %d", self._round_no(), ev.node_id, ev.round)
            return
        why = f"worker failed ({ev.detail})" if ev.detail else "worker failed"
        if ev.blame and rec.state not in HELD:
            self._fault(rec, now, why)
        self._broken.append(f"node {rec.node_id} {why}")

    def _on_replacing(self, ev: Replacing) -> None:
        rec = self._known(ev.node_id, "replacing")
        if rec is None or not self.policy.shrink_to_replace or rec.replacing is ev.replacing:
            return
        rec.replacing = ev.replacing
        log.info("round %d: node %s: %s", self._round_no(), rec.node_id,
                 "warming a replacement for a lost worker" if ev.replacing else "its replacement is warm")
        self._sync(rec)

    def _on_gave_up(self, ev: JobGaveUp) -> None:
        st = self.state
        if st.gave_up:
            return
        if ev.round < st.last_round_number - 1 or (st.round is not None and not self._in_round(ev.node_id)):
            log.info("round %d: node %s: ignored give-up of round %d", self._round_no(), ev.node_id, ev.round)
            return
        st.gave_up = f"the job gave up: node {ev.node_id}: {ev.reason or 'training diverged'}"
        log.error("round %d: %s; no new round will open", self._round_no(), st.gave_up)

    def _close(self, rnd: RoundRecord, why: str) -> list[Decision]:
        self._retire(rnd, set(), why)
        self.state.round = None
        log.warning("round %d: closed: %s", rnd.number, why)
        return [CloseRound(rnd.number, why), *self._status(why)]

    def _on_progress(self, ev: ProgressReport, now: float) -> None:
        rnd = self.state.round
        if rnd is None or not self._in_round(ev.node_id):
            log.info("round %d: node %s: ignored progress report, not in the world",
                     self._round_no(), ev.node_id)
            return
        rec = self.state.nodes[ev.node_id]
        if rec.last_step is not None and ev.step <= rec.last_step:
            return  # a repeated step is a heartbeat, not progress
        rec.last_step, rec.last_progress_at = ev.step, now
        rnd.last_progress_at = now
        if not rnd.training:
            rnd.training = True
            log.info("round %d: training started (node %s at step %d)", rnd.number, rec.node_id, ev.step)

    def _on_checkpoint(self, ev: CheckpointCommitted) -> None:
        st = self.state
        if st.committed_step is None or ev.step > st.committed_step:
            st.committed_step = ev.step
        log.info("round %d: checkpoint at step %d committed (newest %d)",
                 self._round_no(), ev.step, st.committed_step)
        rnd = st.round
        if rnd is not None:
            rnd.last_commit_at = max(rnd.last_commit_at, st.now)
        if rnd is not None and rnd.training and (rnd.restore_step is None or ev.step > rnd.restore_step):
            self._regrow_trigger = f"checkpoint at step {ev.step} committed"

    def _on_drain(self, ev: Drain) -> None:
        rec = self._known(ev.node_id, "drain")
        if rec is None:
            return
        if rec.state in (NodeState.DRAINED, NodeState.QUARANTINED):
            log.info("round %d: node %s: ignored drain, already %s",
                     self._round_no(), rec.node_id, rec.state.value)
            return
        self._move(rec, NodeState.DRAINED, f"drained {ev.why}")
        if self._in_round(rec.node_id):
            self._broken.append(f"node {rec.node_id} drained {ev.why}")

    def _on_cordon(self, ev: Cordon) -> None:
        rec = self._known(ev.node_id, "cordon")
        if rec is None:
            return
        if rec.state in HELD:
            log.info("round %d: node %s: ignored cordon, already %s",
                     self._round_no(), rec.node_id, rec.state.value)
            return
        self._move(rec, NodeState.CORDONED, "cordoned by operator")

    def _on_uncordon(self, ev: Uncordon) -> None:
        rec = self._known(ev.node_id, "uncordon")
        if rec is None:
            return
        if rec.state not in HELD:
            log.info("round %d: node %s: ignored uncordon, node is %s",
                     self._round_no(), rec.node_id, rec.state.value)
            return
        rec.faults.clear()
        self.state.fault_changes.add(rec.node_id)
        if not rec.registered:
            target = NodeState.LOST
        elif rec.health is Health.FATAL:
            target = NodeState.UNHEALTHY
        elif self._in_round(rec.node_id) and rec.state is NodeState.CORDONED:
            target = NodeState.MEMBER  # a cordon keeps the node in its round
        else:
            # drained or quarantined: out of the world, even while the round that leaves it
            # out is still being decided (a quarantine and an uncordon in one batch)
            target = NodeState.WAITING
        self._move(rec, target, "uncordoned by operator")

    def _on_peers_lost(self, ev: PeersLost, now: float) -> None:
        """Members whose workers' collectives broke on a node that no longer answers: once a
        strict majority of the other members (two at least) say so, or one does and the daemon's
        own check finds the node's agent gone, the node is lost now, without waiting for its lease (at scale only
        a lost rank's neighbours in a collective see it fail; the others see a survivor cut its
        connections). It cannot go on training or commit alone (a commit needs every rank of its round),
        and it is left out of the next round only; if it is alive after all, it rejoins by the
        regrow rule."""
        rnd = self.state.round
        if rnd is None or ev.round != rnd.number or not self._in_round(ev.node_id):
            log.info("round %d: node %s: ignored lost-peer report of round %d", self._round_no(), ev.node_id, ev.round)
            return
        self._lost_reports = {rnd.number: self._lost_reports.get(rnd.number, {})}  # older rounds: moot
        reports = self._lost_reports[rnd.number]
        reports[ev.node_id] = ev.lost
        for accused in sorted(ev.lost):
            if not self._in_round(accused) or accused in self._lost_now:
                continue
            others = [m for m in rnd.members if m != accused and self.state.nodes[m].eligible]
            accusers = [m for m in others if accused in reports.get(m, frozenset())]
            # one member's word alone never decides (with a link cut between just two, each accuses the other)
            if others and ((len(accusers) >= 2 and 2 * len(accusers) > len(others)) or accused in ev.confirmed):
                rec = self.state.nodes[accused]
                if rec.health is Health.HEALTHY and rec.state not in HELD:
                    self._fault(rec, now, "lost by its peers")
                rec.lost_by_peers_until = self._held_by_peers[accused] = now + LOST_BY_PEERS_HOLD
                self._sync(rec)
                self._lost_now.add(accused)
                self._broken.append(f"node {accused} lost: its agent does not answer and the workers of "
                                    f"{len(accusers)} of {len(others)} peers lost it")

    def _on_reachability(self, ev: PeerReachability) -> None:
        if not self._in_round(ev.node_id):
            log.info("round %d: node %s: ignored reachability report, not in the world",
                     self._round_no(), ev.node_id)
            return
        self.state.nodes[ev.node_id].unreachable = frozenset(ev.unreachable)

    # --- rules that depend on time or counts ----------------------------------------------------

    def _evaluate(self, now: float) -> list[Decision]:
        for node_id in [n for n, until in self._held_by_peers.items() if now >= until]:
            del self._held_by_peers[node_id]
            rec = self.state.nodes[node_id]
            if rec.lost_by_peers_until is not None:
                rec.lost_by_peers_until = None  # still registered: it was alive after all
                self._sync(rec)
        rnd = self.state.round
        if rnd is None:
            self._away.clear()
            return self._form(now)
        gone = self._agent_not_back(rnd, now)
        if gone:
            return gone
        stalled = self._check_stall(rnd, now)
        if stalled:
            return stalled
        if not rnd.training:
            return self._regrow(now, "the round has not started training")
        if self.state.waiting and now - rnd.last_commit_at >= self.policy.regrow_without_commit:
            return self._regrow(now, f"no checkpoint committed for {now - rnd.last_commit_at:.0f} s")
        return []

    def _form(self, now: float) -> list[Decision]:
        """Open a round when none is open and enough eligible nodes wait."""
        st, pol = self.state, self.policy
        if st.gave_up:
            return self._status(st.gave_up)
        n = len(st.waiting)
        if st.last_round_number == 0:
            deadline = None if st.first_registered_at is None else st.first_registered_at + pol.join_timeout
            if n >= pol.largest_world_size:
                return self._open(now, sorted(st.waiting),
                                  f"first round: {_healthy(n)} fill the largest world "
                                  f"(max_nodes={pol.max_nodes})")
            if deadline is not None and now >= deadline and pol.world_size_for(n) is not None:
                return self._open(now, sorted(st.waiting),
                                  f"first round: join_timeout={pol.join_timeout:g}s passed with {_healthy(n)}")
            if deadline is not None and now < deadline:
                return self._status(f"waiting for the first round: {_healthy(n)} of max_nodes="
                                    f"{pol.max_nodes}, join_timeout ends at t={deadline:.1f}")
            return self._status(self._waiting_reason(n))
        if pol.world_size_for(n) is not None:
            return self._open(now, sorted(st.waiting), f"{_healthy(n)} available again")
        return self._status(self._waiting_reason(n))

    def _agent_not_back(self, rnd: RoundRecord, now: float) -> list[Decision]:
        """Members kept for an agent restart whose agent did not come back within the grace
        leave now, as for a lost lease (a fault)."""
        for node_id in [n for n in self._away if not self._in_round(n)]:
            del self._away[node_id]  # a new round formed without it meanwhile
        late = sorted(n for n, since in self._away.items() if now - since >= self.policy.agent_restart_grace)
        if not late:
            return []
        for node_id in late:
            del self._away[node_id]
            rec = self.state.nodes[node_id]
            if not (rec.health is Health.HEALTHY and self._fault(rec, now, "lease lost")) and rec.state not in HELD:
                self._move(rec, NodeState.LOST, "lease lost")
            self._sync(rec)
        grace = self.policy.agent_restart_grace
        return self._reopen(now, f"node(s) {', '.join(late)} lease lost and no agent came back within {grace:g}s",
                            exclude=set(late))

    def _check_stall(self, rnd: RoundRecord, now: float) -> list[Decision]:
        timeout = self.policy.stall_timeout
        if now - rnd.last_progress_at >= timeout:
            return self._network_stall(rnd, now)
        if now < rnd.stall_check_at:
            return []
        nodes = self.state.nodes
        seen = {m: _or(nodes[m].last_progress_at, rnd.opened_at) for m in rnd.members}
        stalled = [m for m in rnd.members if now - seen[m] >= timeout]
        if not stalled:
            rnd.stall_check_at = min(seen.values()) + timeout
            return []
        for node_id in stalled:
            self._fault(nodes[node_id], now, f"no progress for {timeout:g}s")
        return self._reopen(now, f"node(s) {', '.join(stalled)} made no progress for {timeout:g}s",
                            exclude=set(stalled))

    def _network_stall(self, rnd: RoundRecord, now: float) -> list[Decision]:
        nodes = self.state.nodes
        reports = {m: nodes[m].unreachable for m in rnd.members}
        culprit = name_unreachable_node(rnd.members, reports)
        why = f"network stall: no member made progress for {self.policy.stall_timeout:g}s"
        if culprit is None:
            if all(nodes[m].eligible for m in rnd.members):
                return self._reopen(now, f"{why}; no single unreachable member can be named, "
                                         f"reopening with the same members", newcomers=False)
            return self._reopen(now, f"{why}; no single unreachable member can be named")
        accusers = sum(1 for m in rnd.members if culprit in reports[m])
        self._fault(nodes[culprit], now, "unreachable from its peers")
        return self._reopen(now, f"{why}; node {culprit} is unreachable from {accusers} of "
                                 f"{len(rnd.members) - 1} peers, excluded", exclude={culprit})

    def _regrow(self, now: float, trigger: str) -> list[Decision]:
        st, pol = self.state, self.policy
        rnd = st.round
        if rnd is None or not st.waiting or now - rnd.opened_at < pol.regrow_cooldown:
            return []
        world = len(rnd.members)
        bound = pol.world_size_for(world + len(st.waiting))
        if bound is None or bound <= world:
            return []  # cannot grow even if every member survives
        survivors = [m for m in rnd.members if st.nodes[m].eligible]
        target = pol.world_size_for(len(survivors) + len(st.waiting))
        if target is None or target <= world:
            return []
        return self._open(now, survivors + sorted(st.waiting),
                          f"regrow ({trigger}): {_healthy(len(st.waiting))} waiting")

    # --- opening and closing rounds -------------------------------------------------------------

    def _reopen(self, now: float, why: str, exclude: set[str] | None = None,
                newcomers: bool = True) -> list[Decision]:
        """Replace the open round: its eligible members keep their order, then (if ``newcomers``)
        the waiting nodes sorted by id. ``exclude`` (nodes blamed for a stall) is left out of this
        round only, and only if a feasible world remains without it: otherwise they stay in, since
        a round that might stall again beats no round at all (each stall counts a fault, so a node
        that keeps stalling ends up quarantined)."""
        st = self.state
        rnd = st.round
        assert rnd is not None, "_reopen needs an open round"
        survivors = [m for m in rnd.members if st.nodes[m].eligible]
        replacing = {m for m in survivors if st.nodes[m].replacing}
        skip = (exclude or set()) | replacing
        # A member that lost its lease and registered again in the same batch is both a survivor
        # and waiting: it keeps its place once.
        staying = set(survivors)  # a set: a list here made the reopen O(waiting x members)
        joining = [n for n in sorted(st.waiting) if n not in staying] if newcomers else []
        kept = [m for m in survivors + joining if m not in skip]
        if skip and self.policy.world_size_for(len(kept)) is None:
            left_out = sorted(skip & set(survivors))
            if left_out:
                why += f"; too few nodes without {', '.join(left_out)}, keeping them"
            kept = survivors + joining
        elif replacing:
            why += f"; {', '.join(sorted(replacing))} left out while warming a replacement"
        return self._open(now, kept, why)

    def _open(self, now: float, candidates: list[str], why: str) -> list[Decision]:
        st, pol = self.state, self.policy
        size = pol.world_size_for(len(candidates))
        old = st.round
        if size is None:
            waiting = self._waiting_reason(len(candidates))
            if old is None:
                return self._status(waiting)
            self._retire(old, set(), why)
            st.round = None
            log.warning("round %d: closed: %s; %s", old.number, why, waiting)
            return [CloseRound(old.number, f"{why}; {waiting}"), *self._status(waiting)]
        chosen = candidates[:size]
        if len(candidates) > size:
            why += f" (world {size} of {len(candidates)} eligible: max_nodes={pol.max_nodes}, " \
                   f"node_quantum={pol.node_quantum}, world sizes {_sizes(pol)})"
        number = st.last_round_number + 1
        why += f"; world {len(old.members)} -> {size}" if old is not None else f"; world {size}"
        if old is not None:
            self._retire(old, set(chosen), why)
        st.last_round_number = number
        st.round = RoundRecord(number, tuple(chosen), now, st.committed_step, last_progress_at=now,
                               stall_check_at=now + pol.stall_timeout, last_commit_at=now)
        st.last_status = None
        for node_id in chosen:
            rec = st.nodes[node_id]
            self._reset_round_data(rec)
            self._move(rec, NodeState.MEMBER, f"joins round {number}")
        members = tuple(Member(rank, m, st.nodes[m].address, st.nodes[m].devices)
                        for rank, m in enumerate(chosen))
        log.info("round %d: opened with %d nodes, restore step %s: %s", number, size, st.committed_step, why)
        return [OpenRound(number, members, size, members[0].address, pol.master_port,
                          st.committed_step, why)]

    def _retire(self, old: RoundRecord, staying: set[str], why: str) -> None:
        """Members of ``old`` that are not ``staying`` leave the world."""
        for node_id in old.members:
            rec = self.state.nodes[node_id]
            self._reset_round_data(rec)
            if node_id not in staying and rec.state is NodeState.MEMBER:
                self._move(rec, NodeState.WAITING, f"leaves round {old.number}: {why}")

    @staticmethod
    def _reset_round_data(rec: NodeRecord) -> None:
        rec.last_step, rec.last_progress_at, rec.unreachable = None, None, frozenset()

    def _waiting_reason(self, n: int) -> str:
        pol = self.policy
        need = pol.smallest_world_size
        if need == pol.min_nodes:
            return f"waiting: {_healthy(n)}, min_nodes={pol.min_nodes}"
        return (f"waiting: {_healthy(n)}, a round needs {need} "
                f"(min_nodes={pol.min_nodes}, node_quantum={pol.node_quantum}, world sizes {_sizes(pol)})")

    def _status(self, reason: str) -> list[Decision]:
        if reason == self.state.last_status:
            return []
        self.state.last_status = reason
        log.info("round %d: %s", self._round_no(), reason)
        return [Status(reason)]

    # --- node bookkeeping -----------------------------------------------------------------------

    def expire_faults(self, now: float) -> int:
        """Forget fault times that have left the quarantine window, so that a node's fault record
        in etcd (one key per node that ever faulted) goes once its faults are old: over months, and
        with hosts replaced under new names, those keys would otherwise only accumulate. A
        quarantined node keeps its record (its quarantine outlives its faults). O(nodes); the loop
        calls it once a tick. Returns how many nodes' records changed."""
        changed = 0
        for rec in self.state.nodes.values():
            if rec.faults and now - rec.faults[0] >= self.policy.quarantine_window:
                rec.faults = self._recent(rec.faults, now)
                self.state.fault_changes.add(rec.node_id)
                changed += 1
        return changed

    def _recent(self, faults: list[float], now: float) -> list[float]:
        """The fault times still within the quarantine window."""
        return [t for t in faults if now - t < self.policy.quarantine_window]

    def _fault(self, rec: NodeRecord, now: float, why: str) -> bool:
        """Record a fault; quarantine the node (returning True) when it has too many recent ones."""
        pol = self.policy
        rec.faults = self._recent(rec.faults, now) + [now]
        self.state.fault_changes.add(rec.node_id)
        log.info("round %d: node %s: fault %d within %gs: %s",
                 self._round_no(), rec.node_id, len(rec.faults), pol.quarantine_window, why)
        if len(rec.faults) < pol.quarantine_faults or rec.state in HELD:
            return False
        self._move(rec, NodeState.QUARANTINED,
                   f"{len(rec.faults)} faults within {pol.quarantine_window:g}s (last: {why})")
        return True

    def _move(self, rec: NodeRecord, new: NodeState, why: str) -> None:
        old = rec.state
        if old is not new:
            check_transition(rec.node_id, old, new)
            rec.state = new
            if NodeState.QUARANTINED in (old, new):
                self.state.fault_changes.add(rec.node_id)
            log.info("round %d: node %s: %s -> %s: %s", self._round_no(), rec.node_id, old.value, new.value, why)
        self._sync(rec)

    def _sync(self, rec: NodeRecord) -> None:
        if rec.state is NodeState.WAITING and rec.eligible and not rec.replacing and rec.lost_by_peers_until is None:
            self.state.waiting.add(rec.node_id)
        else:
            self.state.waiting.discard(rec.node_id)

    def _known(self, node_id: str, what: str) -> NodeRecord | None:
        rec = self.state.nodes.get(node_id)
        if rec is None:
            log.warning("round %d: node %s: ignored %s for an unknown node", self._round_no(), node_id, what)
        return rec

    def _in_round(self, node_id: str) -> bool:
        rnd = self.state.round
        return rnd is not None and node_id in rnd.member_set

    def _round_no(self) -> int:
        rnd = self.state.round
        return rnd.number if rnd is not None else self.state.last_round_number


LOST_BY_PEERS_HOLD = 15.0
"""Seconds a node lost by its peers stays out of new rounds unless it registers again. A dead
node's lease expires well within it; a live one (its agent was only slow to answer) rejoins after."""


def _sizes(pol: RoundPolicy) -> str:
    """The allowed node counts, short: ``1, 2, 4 .. 32`` (all of them when they are few)."""
    sizes = pol.allowed_world_sizes
    shown = [str(s) for s in sizes] if len(sizes) <= 8 else [*map(str, sizes[:3]), "..", str(sizes[-1])]
    return ", ".join(shown).replace(", ..,", " ..")


def _healthy(n: int) -> str:
    return f"{n} healthy node" if n == 1 else f"{n} healthy nodes"


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
