"""Turns what etcd holds under a job into round-machine events (the daemon's state holder).

The machine knows nodes by events; this layer remembers what it needs to produce them: which
nodes have a live node key (a DELETE of one is a lost lease), each agent's service address,
operator holds (so that a hold on a node that is not registered yet applies when it registers),
agents draining themselves, and the last reachability report of each node (sent on change
only). Values that do not decode are logged and counted, never raised: a broken agent must not
stop the daemon.

Used from the daemon's loop thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stalwart.coord.client import KeyValue
from stalwart.coord.keys import JobKeys, Kind
from stalwart.coord.watch import EventType, WatchEvent
from stalwart.daemon import codec
from stalwart.daemon.codec import BadRecord, FaultInfo, Hold, RoundInfo
from stalwart.daemon.round_events import (
    CheckpointCommitted,
    Cordon,
    Drain,
    Event,
    HealthVerdict,
    JobGaveUp,
    LeaseLost,
    NodeRegistered,
    PeerReachability,
    PeersLost,
    ProgressReport,
    Replacing,
    Uncordon,
    WorkerFailed,
)

__all__ = ["Feed", "Snapshot"]

log = logging.getLogger(__name__)
_MAX_WARNED = 10_000


@dataclass
class Snapshot:
    """The job as read once when a daemon starts leading, ready for ``RoundMachine.resume``.

    ``round_revision`` is the round key's mod revision (0: absent): the first round write
    compares it, so two leaders can never both write a round after the same one.
    ``round_value`` is the stored record (needed to mark it closed).
    """

    round: RoundInfo | None = None
    round_revision: int = 0
    round_value: bytes = b""
    committed_step: int | None = None
    faults: list[FaultInfo] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    revision: int = 0


class Feed:
    """Converts job keys and watch events into events for the round machine.

    ``on_ignored(kind, reason)`` is called for every value that was ignored (metrics).
    """

    def __init__(self, keys: JobKeys, on_ignored: Callable[[str, str], None] | None = None,
                 host_probe: Callable[[str], bool] | None = None,
                 agent_probe: Callable[[str], bool] | None = None) -> None:
        self.keys = keys
        # host_probe(address): whether the host of an agent address still answers (I/O: set by
        # the loop); asked only for a member whose lease is lost without a planned leave.
        self.host_probe = host_probe
        # agent_probe(address): whether the agent at that address accepts a connection (I/O)
        self.agent_probe = agent_probe
        self.agent_addresses: dict[str, str] = {}
        self.registered: set[str] = set()
        self.known: set[str] = set()
        self.holds: dict[str, Hold] = {}
        self.hold_why: dict[str, str] = {}  # who set each hold, for the round's reason
        self.draining: set[str] = set()
        self.quarantined: set[str] = set()
        self.members: frozenset[str] = frozenset()
        self.round_number = 0
        self._failures_seen: set[tuple[str, int]] = set()  # (node, round): one restart per failure
        self._unreachable: dict[str, frozenset[str]] = {}
        self._replacing: set[str] = set()  # nodes whose last health record said replacing
        self._lost_peers: dict[str, tuple[int, frozenset[str]]] = {}  # last lost-peers report by node
        self._leaving: set[str] = set()  # nodes whose agent announced a graceful stop
        self._warned: set[str] = set()
        self._on_ignored = on_ignored

    # --- the first read -------------------------------------------------------------------------

    def snapshot(self, kvs: Iterable[KeyValue], revision: int) -> Snapshot:
        """Read the whole job (one prefix read) into a :class:`Snapshot` whose ``events`` go into
        one ``handle_batch`` right after ``resume``: registrations first, then what refers to them."""
        snap = Snapshot(revision=revision)
        by_kind: dict[Kind, list[tuple[str | None, KeyValue]]] = {}
        for kv in kvs:
            parsed = self.keys.parse(kv.key)
            if parsed is not None:
                by_kind.setdefault(parsed.kind, []).append((parsed.name, kv))
        for _, kv in by_kind.get(Kind.ROUND, []):
            snap.round_revision, snap.round_value = kv.mod_revision, kv.value
            try:
                snap.round = codec.decode_round(kv.value)
            except BadRecord as exc:
                # Every write of the key was one round, so its version bounds the numbers used.
                log.error("unreadable round record (%s); numbering new rounds above %d", exc, kv.version)
                self._ignored("round", str(exc))
                snap.round = RoundInfo(kv.version, None, "")
        current = snap.round.current if snap.round else None
        self.round_number = snap.round.number if snap.round else 0
        self.members = frozenset(m.node_id for m in current.members) if current else frozenset()
        for name, kv in by_kind.get(Kind.FAULTS, []):
            try:
                snap.faults.append(codec.decode_faults(str(name), kv.value))
            except BadRecord as exc:
                self._ignored("faults", str(exc))
        self.quarantined = {f.node_id for f in snap.faults if f.quarantined}
        for name, kv in by_kind.get(Kind.CORDON, []):
            self._cordon(str(name), kv.value)  # no node is known yet: holds apply at registration
        events: list[Event] = []
        for name, kv in by_kind.get(Kind.NODE, []):
            events += self._node_put(str(name), kv.value)
        for name, kv in by_kind.get(Kind.HEALTH, []):
            events += self._health(str(name), kv.value)
        for name, kv in by_kind.get(Kind.PROGRESS, []):
            events += self._progress(str(name), kv.value)
        # After the progress (whether the round trains decides how a lost lease is taken), and
        # asking each missing member's host, as a lease lost under a running leader would.
        addresses = {m.node_id: m.address for m in current.members} if current else {}
        for m in sorted(self.members - self.registered):
            events.append(LeaseLost(m, host_up=self._host_up(m, addresses.get(m, ""))))
        for name, kv in by_kind.get(Kind.CKPT, []):
            step = int(str(name))
            try:
                codec.decode_ckpt(step, kv.value)
            except BadRecord as exc:
                self._ignored("ckpt", str(exc))
                continue
            snap.committed_step = step if snap.committed_step is None else max(snap.committed_step, step)
        if snap.committed_step is not None:
            events.append(CheckpointCommitted(snap.committed_step))
        snap.events = events
        return snap

    # --- watch events ---------------------------------------------------------------------------

    def convert(self, batch: Iterable[WatchEvent]) -> list[Event]:
        """Events for the machine from one or more watch responses, in order."""
        out: list[Event] = []
        for ev in batch:
            parsed = self.keys.parse(ev.key)
            if parsed is None or parsed.name is None:
                continue  # round, leader, status (our own writes) and keys of other layouts
            name = parsed.name
            kind = parsed.kind
            if kind is Kind.NODE:
                out += self._node_put(name, ev.value) if ev.type is EventType.PUT else self._node_gone(name)
            elif ev.type is EventType.DELETE:
                if kind is Kind.CORDON and self.holds.pop(name, None) is not None and name in self.known:
                    out.append(Uncordon(name))
            elif kind is Kind.HEALTH:
                out += self._health(name, ev.value)
            elif kind is Kind.PROGRESS:
                out += self._progress(name, ev.value)
            elif kind is Kind.CKPT:
                try:
                    out.append(codec.decode_ckpt(parsed.step, ev.value))
                except BadRecord as exc:
                    self._ignored("ckpt", str(exc))
            elif kind is Kind.CORDON:
                out += self._cordon(name, ev.value)
        return out

    def forget_old_rounds(self) -> None:
        """Drop what only older rounds' reports are checked against (call when a round opens):
        a job that runs for months opens thousands of rounds."""
        floor = self.round_number - 1
        self._failures_seen = {(n, r) for n, r in self._failures_seen if abs(r) >= floor}
        self._lost_peers = {n: v for n, v in self._lost_peers.items() if v[0] >= floor}

    # --- per key kind ---------------------------------------------------------------------------

    def _node_put(self, node_id: str, value: bytes) -> list[Event]:
        try:
            info = codec.decode_node(node_id, value)
        except BadRecord as exc:
            self._ignored("node", str(exc))
            return []
        self.agent_addresses[node_id] = info.agent_address
        (self._leaving.add if info.leaving else self._leaving.discard)(node_id)
        out: list[Event] = []
        if node_id not in self.registered:
            self.registered.add(node_id)
            self.known.add(node_id)
            out.append(NodeRegistered(node_id, info.host, info.devices))
            hold = self.holds.get(node_id)
            if hold is Hold.CORDON:
                out.append(Cordon(node_id))
            elif hold is Hold.DRAIN:
                out.append(Drain(node_id, self.hold_why.get(node_id, "by operator")))
        if info.draining and node_id not in self.draining:
            self.draining.add(node_id)
            out.append(Drain(node_id, "by its agent"))
        elif not info.draining and node_id in self.draining:
            # The agent stopped draining (or came back fresh): it may rejoin unless someone else
            # holds it out.
            self.draining.discard(node_id)
            if node_id not in self.holds and node_id not in self.quarantined:
                out.append(Uncordon(node_id))
        return out

    def _node_gone(self, node_id: str) -> list[Event]:
        if node_id not in self.registered:
            return []
        self.registered.discard(node_id)
        self._unreachable.pop(node_id, None)
        self._replacing.discard(node_id)
        planned = node_id in self._leaving
        self._leaving.discard(node_id)
        host_up = not planned and node_id in self.members and self._host_up(node_id,
                                                                            self.agent_addresses.get(node_id, ""))
        return [LeaseLost(node_id, planned=planned, host_up=host_up)]

    def _host_up(self, node_id: str, address: str) -> bool:
        if self.host_probe is None or not address:
            return False
        try:
            return self.host_probe(address)
        except Exception:  # a probe that fails says nothing: treat the host as gone
            log.exception("host probe of node %s at %s failed", node_id, address)
            return False

    def _agent_gone(self, node_id: str, address: str) -> bool:
        if self.agent_probe is None or not address:
            return False
        try:
            return not self.agent_probe(address)
        except Exception:  # a probe that fails says nothing: no confirmation
            log.exception("agent probe of node %s at %s failed", node_id, address)
            return False

    def _health(self, node_id: str, value: bytes) -> list[Event]:
        if not self._is_registered(node_id, "health"):
            return []
        try:
            health, detail, unreachable = codec.decode_health(node_id, value)
        except BadRecord as exc:
            self._ignored("health", str(exc))
            return []
        out: list[Event] = []
        if health is not None:
            out.append(HealthVerdict(node_id, health, detail))
        if node_id in self.members and self._unreachable.get(node_id, frozenset()) != unreachable:
            self._unreachable[node_id] = unreachable
            out.append(PeerReachability(node_id, unreachable))
        gave_up = codec.decode_gave_up(node_id, value)
        if gave_up is not None and node_id in self.members and gave_up[0] >= self.round_number - 1 \
                and (node_id, -gave_up[0]) not in self._failures_seen:
            # round - 1: a peer's broken collective may have restarted the round first
            self._failures_seen.add((node_id, -gave_up[0]))
            out.append(JobGaveUp(node_id, gave_up[0], gave_up[1]))
        lost_round, lost = codec.decode_lost_peers(node_id, value)
        if lost and lost_round == self.round_number and node_id in self.members \
                and self._lost_peers.get(node_id) != (lost_round, lost):
            self._lost_peers[node_id] = (lost_round, lost)
            confirmed = frozenset(n for n in lost if self._agent_gone(n, self.agent_addresses.get(n, "")))
            out.append(PeersLost(node_id, lost_round, lost, confirmed))
        replacing = codec.decode_replacing(node_id, value)
        if replacing != (node_id in self._replacing):  # before the failure: one batch, one new round
            (self._replacing.add if replacing else self._replacing.discard)(node_id)
            out.append(Replacing(node_id, replacing))
        failure = codec.decode_worker_failure(node_id, value)
        if failure is not None and node_id in self.members and failure[0] == self.round_number \
                and (node_id, failure[0]) not in self._failures_seen:
            self._failures_seen.add((node_id, failure[0]))
            out.append(WorkerFailed(node_id, failure[0], failure[1], failure[2]))
        return out

    def _progress(self, node_id: str, value: bytes) -> list[Event]:
        if not self._is_registered(node_id, "progress"):
            return []
        try:
            round_number, step, at = codec.decode_progress(node_id, value)
            busy = codec.decode_busy(node_id, value)
        except BadRecord as exc:
            self._ignored("progress", str(exc))
            return []
        if node_id not in self.members or (round_number and round_number != self.round_number):
            return []  # a report from another round, or from a node outside the world
        return [ProgressReport(node_id, step, at, busy)]

    def _cordon(self, node_id: str, value: bytes) -> list[Event]:
        try:
            hold, why = codec.decode_hold(node_id, value)
        except BadRecord as exc:
            self._ignored("cordon", str(exc))
            return []
        if hold is Hold.NONE:
            self.holds.pop(node_id, None)
            self.quarantined.discard(node_id)
            return [Uncordon(node_id)] if node_id in self.known else []
        self.holds[node_id] = hold
        self.hold_why[node_id] = why
        if node_id not in self.known:
            return []  # applied when the node registers
        return [Cordon(node_id) if hold is Hold.CORDON else Drain(node_id, why)]

    def _is_registered(self, node_id: str, what: str) -> bool:
        if node_id in self.registered:
            return True
        if node_id not in self.known and node_id not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add(node_id)
            log.warning("ignored %s of node %s: no such node is registered", what, node_id,
                        extra={"node": node_id, "round": self.round_number})
            self._ignored(what, "unknown node")
        return False

    def _ignored(self, kind: str, reason: str) -> None:
        if reason != "unknown node":
            log.warning("ignored a malformed %s value: %s", kind, reason, extra={"round": self.round_number})
        if self._on_ignored is not None:
            self._on_ignored(kind, reason)
