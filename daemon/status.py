"""What operators see and do without the daemon's help: the job's state read from etcd, and holds.

``read_status`` reads the whole job prefix once and derives each node's place (in the world,
waiting, lost, unhealthy) and holds (cordoned, drained, quarantined, draining) from the records
the agents and the daemon leader wrote. ``set_hold`` writes an operator hold that the leader
(whichever daemon it is, now or later) applies; it needs no daemon to be running.
"""

from __future__ import annotations

import difflib
import getpass
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field

from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys, Kind
from stalwart.coord.txn import Delete
from stalwart.daemon import codec
from stalwart.daemon.codec import BadRecord, Hold

__all__ = ["JobStatus", "NodeRow", "UnknownTarget", "check_known", "clear_hold", "format_table", "read_status",
           "set_hold"]


class UnknownTarget(LookupError):
    """An operator named a job or node that etcd knows nothing about (most likely a typo)."""


@dataclass
class NodeRow:
    node: str
    place: str = "lost"  # in world, waiting, lost, unhealthy
    rank: int | None = None
    holds: list[str] = field(default_factory=list)  # cordoned, drained, quarantined, draining, replacing
    health: str = "unknown"
    last_step: int | None = None
    step_round: int | None = None
    faults: int = 0
    address: str = ""
    busy_time: float | None = None  # seconds per step outside collectives (recent median)
    step_time: float | None = None  # seconds per step (recent median)
    reported_at: float | None = None  # unix time of the last progress report
    straggler: str = ""  # "straggler" / "excluded straggler" (daemon), "ranks 1,3" (agent: local ranks)
    gave_up: str = ""


@dataclass
class JobStatus:
    job: str
    leader: dict[str, object] | None = None
    round: dict[str, object] | None = None
    status: dict[str, object] | None = None
    checkpoint: dict[str, object] | None = None
    nodes: list[NodeRow] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    @property
    def leading(self) -> bool:
        """Whether a daemon leads the job now: without one no round opens, shrinks or regrows."""
        return self.leader is not None

    @property
    def exists(self) -> bool:
        """Whether etcd holds anything of the job (a daemon, a round, a node, a checkpoint)."""
        return bool(self.leader or self.round or self.status or self.checkpoint or self.nodes)

    def step_rate(self) -> float | None:
        """Training steps a second: one over the median step time of the members reporting."""
        members = set(self.round["members"]) if self.round and not self.round["closed"] else set()  # type: ignore[call-overload]
        times = [r.step_time for r in self.nodes if r.node in members and r.step_time]
        return 1.0 / statistics.median(times) if times else None

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["leading"], out["step_rate"] = self.leading, self.step_rate()
        return out


def _row(rows: dict[str, NodeRow], node: str) -> NodeRow:
    if node not in rows:
        rows[node] = NodeRow(node)
    return rows[node]


def read_status(client: EtcdClient, job: str) -> JobStatus:
    """The job as etcd holds it now (one prefix read). Unreadable values are listed, not raised."""
    keys = JobKeys(job)
    kvs, _ = client.get_prefix(keys.prefix)
    out = JobStatus(job)
    rows: dict[str, NodeRow] = {}
    newest_ckpt: tuple[int, bytes] | None = None
    for kv in kvs:
        parsed = keys.parse(kv.key)
        if parsed is None:
            continue
        name = parsed.name or ""
        try:
            if parsed.kind is Kind.LEADER:
                out.leader = codec.leader_summary(kv.value)
            elif parsed.kind is Kind.ROUND:
                out.round = codec.round_summary(kv.value)
            elif parsed.kind is Kind.STATUS:
                out.status = codec.status_summary(kv.value)
            elif parsed.kind is Kind.CKPT:
                if newest_ckpt is None or parsed.step > newest_ckpt[0]:
                    newest_ckpt = (parsed.step, kv.value)
            elif parsed.kind is Kind.NODE:
                info = codec.decode_node(name, kv.value)
                row = _row(rows, name)
                row.place, row.address = "waiting", info.agent_address
                if info.draining:
                    row.holds.append("draining")
            elif parsed.kind is Kind.HEALTH:
                _row(rows, name).health = codec.health_name(kv.value, name)
                if codec.decode_replacing(name, kv.value):
                    _row(rows, name).holds.append("replacing")  # out until its replacement is warm
            elif parsed.kind is Kind.PROGRESS:
                round_number, step, reported_at = codec.decode_progress(name, kv.value)
                row = _row(rows, name)
                row.last_step, row.step_round, row.reported_at = step, round_number, reported_at or None
                extra = codec.progress_summary(name, kv.value)
                row.busy_time = float(extra["busy_time"]) or None  # type: ignore[arg-type]
                row.step_time = float(extra["step_time"]) or None  # type: ignore[arg-type]
                row.gave_up = str(extra["gave_up"])
                local = extra["straggling_ranks"]
                if local:
                    row.straggler = "local ranks " + ",".join(str(r) for r in local)  # type: ignore[attr-defined]
            elif parsed.kind is Kind.CORDON:
                hold = codec.decode_cordon(name, kv.value)
                if hold is not Hold.NONE:
                    _row(rows, name).holds.append("cordoned" if hold is Hold.CORDON else "drained")
            elif parsed.kind is Kind.FAULTS:
                faults = codec.decode_faults(name, kv.value)
                row = _row(rows, name)
                row.faults = len(faults.fault_times)
                if faults.quarantined:
                    row.holds.append("quarantined")
        except BadRecord as exc:
            out.unreadable.append(f"{kv.key}: {exc}")
    if newest_ckpt is not None:
        try:
            out.checkpoint = codec.ckpt_summary(*newest_ckpt)
        except BadRecord as exc:
            out.unreadable.append(f"checkpoint {newest_ckpt[0]}: {exc}")
    for s in (out.status or {}).get("stragglers", []):  # type: ignore[attr-defined]
        _row(rows, s["node"]).straggler = "excluded straggler" if s["excluded"] else "straggler"
    members: list[str] = list(out.round["members"]) if out.round and not out.round["closed"] else []  # type: ignore[call-overload]
    for rank, node in enumerate(members):
        row = _row(rows, node)
        row.rank = rank
        if row.place == "waiting":
            row.place = "in world"
    for row in rows.values():
        if row.place == "waiting" and row.health == "fatal":
            row.place = "unhealthy"
    out.nodes = sorted(rows.values(), key=lambda r: (r.rank is None, r.rank or 0, r.node))
    return out


def age(at: object, now: float) -> str:
    """``12s ago``, ``5m ago``, ``3h ago``, ``2d ago``; ``-`` for no time."""
    if not isinstance(at, (int, float)) or at <= 0:
        return "-"
    seconds = max(0.0, now - at)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def format_table(st: JobStatus, now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"job {st.job}"]
    leader = st.leader
    if leader:
        lines.append(f"leader: {leader['daemon_id']} ({leader['address']}), elected {age(leader['elected_at'], now)}")
    else:
        lines.append("leader: none: no daemon leads this job, so no round opens, shrinks or regrows "
                     "(start `stalwart daemon`)")
    rnd = st.round
    if rnd is None:
        lines.append("round: none yet")
    else:
        state = "closed" if rnd["closed"] else "open"
        lines.append(f"round {rnd['number']} ({state}, decided {age(rnd['decided_at'], now)}): {rnd['nodes']} nodes, "
                     f"{rnd['workers']} workers, master {rnd['master'] or '-'}, restore step "
                     f"{rnd['restore_step'] if rnd['restore_step'] is not None else 'none'}")
        if rnd["reason"]:
            lines.append(f"  why: {rnd['reason']}")
    rate = st.step_rate()
    if rate is not None:
        lines.append(f"step rate: {rate:.3g} steps/s (median of the members' step times)")
    lines += goodput_lines((st.status or {}).get("goodput"), now)  # type: ignore[arg-type]
    if st.status and st.status["reason"]:
        said = f"daemon {st.status['daemon_id']} said {age(st.status['at'], now)}"
        lines.append(f"daemon: {st.status['reason']} ({said})" if leader else
                     f"last status ({said}, no daemon leads now): {st.status['reason']}")
    for s in (st.status or {}).get("stragglers", []):  # type: ignore[attr-defined]
        lines.append(f"straggler: {s['node']}: busy {s['busy_time']:.3f} s/step vs {s['others_median']:.3f} s "
                     f"median of the others, {s['consecutive']} reports in a row since step {s['since_step']}"
                     + (" (excluded at a checkpoint)" if s["excluded"] else ""))
    ck = st.checkpoint
    lines.append(f"newest checkpoint: step {ck['step']} at {ck['path'] or '-'}, "
                 f"committed {age(ck['committed_at'], now)}" if ck else "newest checkpoint: none")
    counts: dict[str, int] = {}
    for row in st.nodes:
        counts[row.place] = counts.get(row.place, 0) + 1
    lines.append("nodes: " + (", ".join(f"{n} {place}" for place, n in sorted(counts.items())) or "none"))
    if st.nodes:
        width = max(4, *(len(r.node) for r in st.nodes))
        lines.append(f"{'node':<{width}}  {'rank':>4}  {'state':<10} {'holds':<22} {'health':<9} "
                     f"{'last step':>10}  {'reported':>9}  {'step s':>7}  {'busy s':>7}  {'faults':>6}  address")
        for r in st.nodes:
            step = "-" if r.last_step is None else f"{r.last_step}" + (
                f" (r{r.step_round})" if r.step_round and rnd and r.step_round != rnd["number"] else "")
            busy = "-" if r.busy_time is None else f"{r.busy_time:.3f}"
            step_s = "-" if r.step_time is None else f"{r.step_time:.3f}"
            lines.append(f"{r.node:<{width}}  {'-' if r.rank is None else r.rank:>4}  {r.place:<10} "
                         f"{','.join(r.holds) or '-':<22} {r.health:<9} {step:>10}  {age(r.reported_at, now):>9}  "
                         f"{step_s:>7}  {busy:>7}  {r.faults:>6}  "
                         f"{r.address or '-'}" + (f"  [{r.straggler}]" if r.straggler else "")
                         + (f"  gave up: {r.gave_up}" if r.gave_up else ""))
    for problem in st.unreadable:
        lines.append(f"unreadable: {problem}")
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """``42s``, ``12m05s``, ``3h20m``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def goodput_lines(g: dict[str, object] | None, now: float) -> list[str]:
    """The job's goodput so far and its recent faults with what each cost (from the leader)."""
    if not g:
        return []
    ratio, step_time = g.get("ratio"), g.get("step_time")
    head = "goodput: " + (f"{ratio:.1%}" if isinstance(ratio, float) else "-")
    head += (f" (productive {duration(float(g['productive_seconds']))} of "  # type: ignore[arg-type]
             f"{duration(float(g['elapsed_seconds']))})")  # type: ignore[arg-type]
    if int(g["step"]) >= 0:  # type: ignore[call-overload]
        head += f", job step {g['step']}"
    if isinstance(step_time, float):
        head += f", {step_time:.3g} s/step"
    lines = [head]
    faults = list(g.get("faults") or [])  # type: ignore[call-overload]
    for f in reversed(faults[-5:]):
        cost = f["cost"]
        lines.append(f"  fault: {f['node']} {f['kind']} {age(f['at'], now)} at step {f['step']}: "
                     + (f"cost {duration(cost)}" if cost is not None else "training not past it yet"))
    return lines


def set_hold(client: EtcdClient, job: str, node: str, hold: Hold, reason: str = "") -> None:
    """Write an operator hold (or, with ``Hold.NONE``, lift any hold and a quarantine).

    The record stays in etcd without a lease, so the hold outlives the node's registration and
    the daemon leader. Raises ``EtcdConfigError`` for a bad node name, ``CoordError`` when etcd
    cannot be written.
    """
    keys = JobKeys(job)
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    client.put(keys.cordon(node), codec.encode_cordon(node, hold, reason, by, time.time()))


def clear_hold(client: EtcdClient, job: str, node: str) -> None:
    """Lift a node's hold and quarantine, then remove its keys.

    The lifting record comes first, so that a leading daemon (which follows the keys) lifts the
    hold and quarantine it holds in memory; then the cordon key and the fault history go, so no
    record of a lifted hold (or of a mistyped name) stays in etcd, and a later leader finds no
    quarantine to restore.
    """
    keys = JobKeys(job)
    set_hold(client, job, node, Hold.NONE)
    client.txn([], [Delete(keys.cordon(node)), Delete(keys.faults(node))])


def check_known(status: JobStatus, node: str) -> None:
    """Raise :class:`UnknownTarget` unless etcd knows the job and the node: a registered node,
    a member of the round, or one with health, progress, a hold or a fault history."""
    if not status.exists:
        raise UnknownTarget(f"job {status.job!r} has nothing in etcd (no daemon, round or node): a typo?")
    known = sorted({r.node for r in status.nodes})
    if node in known:
        return
    close = difflib.get_close_matches(node, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known) or 'none'}"
    raise UnknownTarget(f"node {node!r} is not known in job {status.job!r} ({hint})")
