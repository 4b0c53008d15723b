"""etcd values <-> the round machine's events and decisions: the daemon's only use of ``*_pb2``.

Decoders take a value as stored under a job key and return plain data, or raise
:class:`BadRecord` when the bytes are not the record the key calls for (so the caller can log
and ignore it: a malformed value written by a broken agent must never stop the daemon).
Encoders return the bytes to store.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from stalwart.daemon.errors import DaemonError
from stalwart.daemon.round_events import CheckpointCommitted, CloseRound, Health, Member, OpenRound
from stalwart.proto import records_pb2
from stalwart.proto.contract import GAVE_UP_PREFIX  # a closed round whose reason starts so stays closed

__all__ = [
    "BadRecord", "FaultInfo", "Hold", "NodeInfo", "RoundInfo", "ckpt_summary", "decode_ckpt", "decode_cordon",
    "decode_hold", "decode_faults", "decode_health", "decode_node", "decode_progress", "decode_round",
    "decode_worker_failure", "encode_closed",
    "encode_cordon", "encode_faults", "encode_leader", "encode_round", "encode_status", "health_name", "host_of",
    "leader_summary", "round_summary", "status_summary",
]


class BadRecord(DaemonError, ValueError):
    """An etcd value is not the record its key calls for (undecodable, or contradicts its key)."""


class Hold(enum.Enum):
    """An operator's hold on a node, as stored at ``cordon/<node>``."""

    NONE = "none"  # lifted by uncordon
    CORDON = "cordon"
    DRAIN = "drain"


_HOLD_FROM_PB = {records_pb2.HOLD_NONE: Hold.NONE, records_pb2.HOLD_CORDON: Hold.CORDON,
                 records_pb2.HOLD_DRAIN: Hold.DRAIN}
_HOLD_TO_PB = {v: k for k, v in _HOLD_FROM_PB.items()}
_HEALTH = {records_pb2.HEALTH_OK: Health.HEALTHY, records_pb2.HEALTH_TRANSIENT: Health.TRANSIENT,
           records_pb2.HEALTH_FATAL: Health.FATAL}


@dataclass(frozen=True)
class NodeInfo:
    """A node record. ``agent_address`` is the agent's service (host:port), put in round records
    so that agents can probe each other; ``host`` is what peers use as the master address.
    ``draining`` is the agent's own drain flag (``NodeRecord.cordoned``); ``leaving``: the agent
    is stopping on purpose, so the lease loss that follows is not a fault."""

    node_id: str
    agent_address: str
    host: str
    devices: int
    draining: bool
    leaving: bool = False


@dataclass(frozen=True)
class FaultInfo:
    node_id: str
    fault_times: tuple[float, ...]  # unix seconds
    quarantined: bool


@dataclass(frozen=True)
class RoundInfo:
    """The round key: the newest round's number, and the round itself unless it was closed."""

    number: int
    current: OpenRound | None
    decided_by: str
    gave_up: str = ""  # the round was closed because the job gave up (reason)


def _parse(cls: type[Message], value: bytes, what: str) -> Message:
    msg = cls()
    try:
        msg.ParseFromString(value)
    except (DecodeError, ValueError, TypeError) as exc:
        raise BadRecord(f"{what}: not a {cls.__name__}: {exc}") from exc
    return msg


def _check_id(record_id: str, node_id: str, what: str) -> None:
    if record_id and record_id != node_id:
        raise BadRecord(f"{what}: record names node {record_id!r}, key names {node_id!r}")


def host_of(address: str) -> str:
    """``host:port`` or ``[v6]:port`` -> the host; an address without a port is returned as is."""
    if address.startswith("["):
        return address[1:].partition("]")[0]
    if address.count(":") == 1:
        return address.partition(":")[0]
    return address


def decode_node(node_id: str, value: bytes) -> NodeInfo:
    rec = _parse(records_pb2.NodeRecord, value, f"node {node_id}")
    _check_id(rec.node_id, node_id, f"node {node_id}")
    address = rec.address or rec.hostname
    host = host_of(address) or rec.hostname
    if not host:
        raise BadRecord(f"node {node_id}: record has neither an address nor a hostname")
    if rec.devices < 1:
        raise BadRecord(f"node {node_id}: devices must be at least 1, got {rec.devices}")
    return NodeInfo(node_id, address, host, int(rec.devices), bool(rec.cordoned), bool(rec.leaving))


def decode_health(node_id: str, value: bytes) -> tuple[Health | None, str, frozenset[str]]:
    """The verdict (None for HEALTH_UNKNOWN: no verdict yet), a detail for operators, and the
    peers the node reports unreachable."""
    rec = _parse(records_pb2.HealthRecord, value, f"health {node_id}")
    _check_id(rec.node_id, node_id, f"health {node_id}")
    detail = ", ".join(f"{f.code} on device {f.device}" if f.code else f.detail for f in rec.findings)
    return _HEALTH.get(rec.state), detail, frozenset(rec.unreachable_peers)


# Worker findings that mean this node caused its round to fail, rather than suffering a peer's
# ("worker-user-error": an error exit, usually a collective broken by a peer; "stall-waiting": a
# running process stuck, usually waiting in a collective for a peer that stalled).
BLAMED_WORKER_CODES = frozenset({"worker-signal", "worker-oom-killed", "stall"})


def decode_worker_failure(node_id: str, value: bytes) -> tuple[int, bool, str] | None:
    """(round, blame, detail) when the agent reports failed workers (a worker exit or a stall
    finding carrying its round), else None."""
    rec = _parse(records_pb2.HealthRecord, value, f"health {node_id}")
    _check_id(rec.node_id, node_id, f"health {node_id}")
    failed = [f for f in rec.findings if f.round and (f.source == "stall" or f.code.startswith("worker-"))]
    if not failed:
        return None
    latest = max(f.round for f in failed)
    mine = [f for f in failed if f.round == latest]
    return int(latest), any(f.code in BLAMED_WORKER_CODES for f in mine), "; ".join(f.detail or f.code for f in mine)


def decode_lost_peers(node_id: str, value: bytes) -> tuple[int, frozenset[str]]:
    """(round, members) the node's workers lost, whose agents do not answer (HealthRecord.lost_peers)."""
    rec = _parse(records_pb2.HealthRecord, value, f"health {node_id}")
    _check_id(rec.node_id, node_id, f"health {node_id}")
    return int(rec.lost_peers_round), frozenset(rec.lost_peers)


def decode_replacing(node_id: str, value: bytes) -> bool:
    """Whether the node is warming a replacement for a lost worker (HealthRecord.replacing)."""
    rec = _parse(records_pb2.HealthRecord, value, f"health {node_id}")
    _check_id(rec.node_id, node_id, f"health {node_id}")
    return bool(rec.replacing)


GAVE_UP_CODE = "job-gave-up"


def decode_gave_up(node_id: str, value: bytes) -> tuple[int, str] | None:
    """(round, detail) when the agent reports that a worker gave up the job (EXIT_DIVERGED)."""
    rec = _parse(records_pb2.HealthRecord, value, f"health {node_id}")
    _check_id(rec.node_id, node_id, f"health {node_id}")
    gave_up = [f for f in rec.findings if f.code == GAVE_UP_CODE and f.round]
    if not gave_up:
        return None
    latest = max(gave_up, key=lambda f: f.round)
    return int(latest.round), latest.detail


def decode_busy(node_id: str, value: bytes) -> float:
    """The node's busy seconds per step (0: unknown) from its progress record."""
    rec = _parse(records_pb2.ProgressRecord, value, f"progress {node_id}")
    busy = float(rec.busy_time)
    return busy if busy > 0 and busy == busy and busy != float("inf") else 0.0


def decode_progress(node_id: str, value: bytes) -> tuple[int, int, float]:
    """(round, step, reported_at)."""
    rec = _parse(records_pb2.ProgressRecord, value, f"progress {node_id}")
    _check_id(rec.node_id, node_id, f"progress {node_id}")
    return int(rec.round), int(rec.step), float(rec.reported_at)


def decode_ckpt(step: int, value: bytes) -> CheckpointCommitted:
    rec = _parse(records_pb2.CheckpointRecord, value, f"checkpoint {step}")
    if rec.step != step:
        raise BadRecord(f"checkpoint {step}: record says step {rec.step}")
    return CheckpointCommitted(step)


def decode_cordon(node_id: str, value: bytes) -> Hold:
    return decode_hold(node_id, value)[0]


def decode_hold(node_id: str, value: bytes) -> tuple[Hold, str]:
    """The hold and who set it, for a round's reason: ``by operator`` or ``by daemon d0: <why>``."""
    rec = _parse(records_pb2.CordonRecord, value, f"cordon {node_id}")
    _check_id(rec.node_id, node_id, f"cordon {node_id}")
    hold = _HOLD_FROM_PB.get(rec.kind)
    if hold is None:
        raise BadRecord(f"cordon {node_id}: unknown hold kind {rec.kind}")
    if rec.by.startswith("daemon"):
        return hold, f"by {rec.by}" + (f" ({rec.reason})" if rec.reason else "")
    return hold, "by operator"


def decode_faults(node_id: str, value: bytes) -> FaultInfo:
    rec = _parse(records_pb2.FaultRecord, value, f"faults {node_id}")
    _check_id(rec.node_id, node_id, f"faults {node_id}")
    return FaultInfo(node_id, tuple(rec.fault_times), bool(rec.quarantined))


def decode_round(value: bytes) -> RoundInfo:
    rec = _parse(records_pb2.RoundRecord, value, "round")
    if rec.number < 1:
        raise BadRecord(f"round: number must be at least 1, got {rec.number}")
    ranks = [m.node_rank for m in rec.members]
    if ranks != list(range(len(ranks))) or not rec.members:
        raise BadRecord(f"round {rec.number}: members are not ranks 0..W-1: {ranks}")
    if rec.closed:
        return RoundInfo(int(rec.number), None, rec.decided_by,
                         rec.reason if rec.reason.startswith(GAVE_UP_PREFIX) else "")
    members = tuple(Member(int(m.node_rank), m.node_id, host_of(m.address) or rec.master_addr,
                           max(1, int(m.local_world_size))) for m in rec.members)
    restore = int(rec.restore_step) if rec.has_restore_step else None
    current = OpenRound(int(rec.number), members, len(members), rec.master_addr, int(rec.master_port),
                        restore, rec.reason)
    return RoundInfo(int(rec.number), current, rec.decided_by)


def _round_record(decision: OpenRound, agent_addresses: Mapping[str, str], daemon_id: str,
                  at: float) -> records_pb2.RoundRecord:
    rec = records_pb2.RoundRecord(
        number=decision.number, master_addr=decision.master_addr, master_port=decision.master_port,
        reason=decision.reason, decided_by=daemon_id, decided_at=at,
        has_restore_step=decision.restore_step is not None, restore_step=decision.restore_step or 0,
    )
    first = 0
    for m in decision.members:
        rec.members.add(node_id=m.node_id, node_rank=m.rank, first_rank=first, local_world_size=m.devices,
                        address=agent_addresses.get(m.node_id, m.address))
        first += m.devices
    rec.world_size = first
    return rec


def encode_round(decision: OpenRound, agent_addresses: Mapping[str, str], daemon_id: str, at: float) -> bytes:
    """The round record agents follow; ``world_size`` in it counts workers, not nodes."""
    return _round_record(decision, agent_addresses, daemon_id, at).SerializeToString()


def encode_closed(previous: bytes, decision: CloseRound, daemon_id: str, at: float) -> bytes:
    """Round ``decision.number`` closed: its own record (``previous``) marked closed, so a round
    number never names two different worlds."""
    rec = _parse(records_pb2.RoundRecord, previous, "round")
    if rec.number != decision.number:
        raise BadRecord(f"round: closing round {decision.number} but the record is round {rec.number}")
    rec.closed, rec.reason, rec.decided_by, rec.decided_at = True, decision.reason, daemon_id, at
    return rec.SerializeToString()


def encode_faults(node_id: str, fault_times: Sequence[float], quarantined: bool, reason: str,
                  daemon_id: str) -> bytes:
    return records_pb2.FaultRecord(node_id=node_id, fault_times=list(fault_times), quarantined=quarantined,
                                   reason=reason, written_by=daemon_id).SerializeToString()


def encode_status(reason: str, round_number: int, daemon_id: str, at: float,
                  stragglers: Sequence[records_pb2.Straggler] = (),
                  goodput: records_pb2.JobGoodput | None = None) -> bytes:
    return records_pb2.DaemonStatus(reason=reason, round=round_number, daemon_id=daemon_id, at=at,
                                    stragglers=list(stragglers), goodput=goodput).SerializeToString()


def decode_goodput(value: bytes) -> records_pb2.JobGoodput | None:
    """The goodput a previous leader wrote into the status record (None: none, or unreadable)."""
    try:
        rec = records_pb2.DaemonStatus.FromString(value)
    except DecodeError:
        return None
    return rec.goodput if rec.HasField("goodput") else None


def encode_leader(daemon_id: str, address: str, at: float) -> bytes:
    return records_pb2.LeaderRecord(daemon_id=daemon_id, address=address, elected_at=at).SerializeToString()


def encode_cordon(node_id: str, hold: Hold, reason: str, by: str, at: float) -> bytes:
    return records_pb2.CordonRecord(node_id=node_id, kind=_HOLD_TO_PB[hold], reason=reason, by=by,
                                    at=at).SerializeToString()


# --- summaries for display (``stalwart status``): plain, JSON-ready dicts -----------------------


def round_summary(value: bytes) -> dict[str, object]:
    rec = _parse(records_pb2.RoundRecord, value, "round")
    return {
        "number": int(rec.number), "closed": bool(rec.closed), "nodes": len(rec.members),
        "workers": int(rec.world_size), "members": [m.node_id for m in rec.members],
        "master": f"{rec.master_addr}:{rec.master_port}" if rec.master_addr else "",
        "restore_step": int(rec.restore_step) if rec.has_restore_step else None,
        "reason": rec.reason, "decided_by": rec.decided_by, "decided_at": rec.decided_at,
    }


def ckpt_summary(step: int, value: bytes) -> dict[str, object]:
    rec = _parse(records_pb2.CheckpointRecord, value, f"checkpoint {step}")
    return {"step": int(rec.step), "path": rec.path, "world_size": int(rec.world_size), "round": int(rec.round),
            "committed_at": rec.committed_at, "manifest_digest": rec.manifest_digest}


def leader_summary(value: bytes) -> dict[str, object]:
    rec = _parse(records_pb2.LeaderRecord, value, "leader")
    return {"daemon_id": rec.daemon_id, "address": rec.address, "elected_at": rec.elected_at}


def status_summary(value: bytes) -> dict[str, object]:
    rec = _parse(records_pb2.DaemonStatus, value, "status")
    stragglers = [{"node": s.node_id, "busy_time": s.busy_time, "others_median": s.others_median,
                   "consecutive": int(s.consecutive), "excluded": bool(s.excluded), "since_step": int(s.since_step)}
                  for s in rec.stragglers]
    goodput = None
    if rec.HasField("goodput"):
        g = rec.goodput
        goodput = {"productive_seconds": g.productive_seconds, "elapsed_seconds": g.elapsed_seconds,
                   "ratio": min(1.0, g.productive_seconds / g.elapsed_seconds) if g.elapsed_seconds > 0 else None,
                   "step": int(g.step), "step_time": g.step_time or None,
                   "faults": [{"node": f.node_id, "kind": f.kind, "at": f.at, "step": int(f.step),
                               "cost": f.cost if f.known else None} for f in g.faults]}
    return {"reason": rec.reason, "round": int(rec.round), "daemon_id": rec.daemon_id, "at": rec.at,
            "stragglers": stragglers, "goodput": goodput}


def progress_summary(node_id: str, value: bytes) -> dict[str, object]:
    """Busy time, local straggling ranks and the give-up reason of a node's progress record."""
    rec = _parse(records_pb2.ProgressRecord, value, f"progress {node_id}")
    return {"busy_time": float(rec.busy_time), "step_time": float(rec.step_time),
            "straggling_ranks": [int(r) for r in rec.straggling_ranks],
            "gave_up": rec.gave_up_reason if rec.gave_up else "",
            "committed_step": int(rec.committed_step) if rec.has_committed_step else None}


def health_name(value: bytes, node_id: str) -> str:
    """``ok``, ``transient``, ``fatal`` or ``unknown`` for display."""
    health, _, _ = decode_health(node_id, value)
    return "unknown" if health is None else {"healthy": "ok"}.get(health.value, health.value)
