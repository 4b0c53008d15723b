"""The daemon's edges without etcd: record codec, the feed (state holder), take-over restore of
faults and quarantine, and the systemd notify protocol."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from stalwart.coord.client import KeyValue
from stalwart.coord.keys import JobKeys
from stalwart.coord.watch import EventType, WatchEvent
from stalwart.daemon import codec
from stalwart.daemon.codec import BadRecord, Hold
from stalwart.daemon.feed import Feed
from stalwart.daemon.nodes import NodeState
from stalwart.daemon.observe import SystemdNotifier
from stalwart.daemon.policy import RoundPolicy
from stalwart.daemon.round_events import (
    CheckpointCommitted,
    CloseRound,
    Cordon,
    Drain,
    Health,
    HealthVerdict,
    LeaseLost,
    Member,
    NodeRegistered,
    OpenRound,
    PeerReachability,
    ProgressReport,
    Uncordon,
)
from stalwart.daemon.rounds import RoundMachine
from stalwart.proto import records_pb2

KEYS = JobKeys("job")
GARBAGE = b"\xff\xfe\x00 not a record"


def _node(node: str, draining: bool = False, devices: int = 2) -> bytes:
    return records_pb2.NodeRecord(node_id=node, address=f"{node}.x:7077", devices=devices,
                                  cordoned=draining).SerializeToString()


def _kv(key: str, value: bytes, rev: int = 5) -> KeyValue:
    return KeyValue(key, value, rev, rev, 1, 0)


def _put(key: str, value: bytes) -> WatchEvent:
    return WatchEvent(EventType.PUT, key, value, 9, 9, 1, 0)


def _delete(key: str) -> WatchEvent:
    return WatchEvent(EventType.DELETE, key, b"", 9, 0, 0, 0)


OPEN = OpenRound(4, (Member(0, "a", "a.x", 2), Member(1, "b", "b.x", 4)), 2, "a.x", 29500, 100, "why")


# --- codec --------------------------------------------------------------------------------------


def test_round_record_round_trip_with_worker_ranks() -> None:
    value = codec.encode_round(OPEN, {"a": "a.x:7077", "b": "b.x:7077"}, "d1", 1.0)
    rec = records_pb2.RoundRecord.FromString(value)
    assert [(m.node_rank, m.first_rank, m.local_world_size) for m in rec.members] == [(0, 0, 2), (1, 2, 4)]
    assert rec.world_size == 6 and rec.members[1].address == "b.x:7077" and rec.decided_by == "d1"
    back = codec.decode_round(value)
    assert back.number == 4 and back.current is not None
    assert back.current.members == OPEN.members and back.current.restore_step == 100


def test_a_closed_round_keeps_its_number_and_members() -> None:
    value = codec.encode_round(OPEN, {}, "d1", 1.0)
    closed = codec.encode_closed(value, CloseRound(4, "too few"), "d2", 2.0)
    info = codec.decode_round(closed)
    assert info.number == 4 and info.current is None
    assert [m.node_id for m in records_pb2.RoundRecord.FromString(closed).members] == ["a", "b"]
    with pytest.raises(BadRecord):
        codec.encode_closed(value, CloseRound(5, "not this one"), "d2", 2.0)


@pytest.mark.parametrize("decode", [
    lambda v: codec.decode_node("a", v), lambda v: codec.decode_health("a", v),
    lambda v: codec.decode_progress("a", v), lambda v: codec.decode_ckpt(3, v), lambda v: codec.decode_cordon("a", v),
    lambda v: codec.decode_faults("a", v), codec.decode_round,
])
def test_garbage_is_a_bad_record(decode: object) -> None:
    with pytest.raises(BadRecord):
        decode(GARBAGE)  # type: ignore[operator]


def test_records_that_contradict_their_key_are_bad() -> None:
    with pytest.raises(BadRecord):
        codec.decode_node("a", _node("b"))
    with pytest.raises(BadRecord):
        codec.decode_node("a", _node("a", devices=0))
    with pytest.raises(BadRecord):
        codec.decode_ckpt(3, records_pb2.CheckpointRecord(step=4).SerializeToString())
    with pytest.raises(BadRecord):
        codec.decode_round(records_pb2.RoundRecord(number=0).SerializeToString())


@pytest.mark.parametrize(("address", "host"), [("h:1", "h"), ("[::1]:7", "::1"), ("h", "h"), ("::1", "::1")])
def test_host_of(address: str, host: str) -> None:
    assert codec.host_of(address) == host


# --- feed ---------------------------------------------------------------------------------------


def test_snapshot_orders_registrations_first_and_skips_bad_values() -> None:
    ignored: list[str] = []
    feed = Feed(KEYS, on_ignored=lambda kind, why: ignored.append(kind))
    health_a = records_pb2.HealthRecord(node_id="a", state=records_pb2.HEALTH_FATAL).SerializeToString()
    kvs = [
        _kv(KEYS.round, codec.encode_round(OPEN, {}, "d1", 1.0), rev=7),
        _kv(KEYS.ckpt(100), records_pb2.CheckpointRecord(step=100).SerializeToString()),
        _kv(KEYS.ckpt(200), GARBAGE),
        _kv(KEYS.cordon("c"), codec.encode_cordon("c", Hold.CORDON, "", "op", 0.0)),
        _kv(KEYS.faults("q"), codec.encode_faults("q", [1.0], True, "", "d1")),
        _kv(KEYS.health("a"), health_a),
        _kv(KEYS.health("ghost"), health_a),
        _kv(KEYS.node("a"), _node("a")),
        _kv(KEYS.node("c"), _node("c")),
        _kv(KEYS.node("x"), GARBAGE),
    ]
    snap = feed.snapshot(kvs, 42)
    assert snap.round is not None and snap.round.number == 4 and snap.round_revision == 7
    assert snap.committed_step == 100 and [f.node_id for f in snap.faults] == ["q"]
    assert snap.events == [
        NodeRegistered("a", "a.x", 2), NodeRegistered("c", "c.x", 2), Cordon("c"),
        HealthVerdict("a", Health.FATAL, ""), LeaseLost("b"), CheckpointCommitted(100),
    ]  # a member's lost lease after the progress: whether the round trains decides how it is taken
    assert sorted(ignored) == ["ckpt", "health", "node"]  # garbage ckpt and node, unknown node's health


def test_watch_events_become_machine_events() -> None:
    feed = Feed(KEYS)
    feed.snapshot([], 1)
    feed.members, feed.round_number = frozenset({"a"}), 3
    progress = records_pb2.ProgressRecord(node_id="a", round=3, step=7, reported_at=5.0).SerializeToString()
    stale = records_pb2.ProgressRecord(node_id="a", round=2, step=9).SerializeToString()
    health = records_pb2.HealthRecord(node_id="a", state=records_pb2.HEALTH_OK,
                                      unreachable_peers=["b"]).SerializeToString()
    events = feed.convert([
        _put(KEYS.cordon("z"), codec.encode_cordon("z", Hold.DRAIN, "", "op", 0.0)),  # not known yet
        _put(KEYS.node("a"), _node("a")), _put(KEYS.node("a"), _node("a")),  # a re-put is no registration
        _put(KEYS.progress("a"), progress), _put(KEYS.progress("a"), stale),
        _put(KEYS.health("a"), health), _put(KEYS.health("a"), health),  # reachability sent on change only
        _put(KEYS.node("z"), _node("z")),
        _put(KEYS.node("a"), _node("a", draining=True)), _put(KEYS.node("a"), _node("a")),
        _put(KEYS.ckpt(5), records_pb2.CheckpointRecord(step=5).SerializeToString()),
        _put(KEYS.round, GARBAGE), _put(KEYS.leader, GARBAGE), _put(KEYS.prefix + "other/x", GARBAGE),
        _delete(KEYS.node("z")), _delete(KEYS.node("z")), _delete(KEYS.cordon("z")),
    ])
    assert events == [
        NodeRegistered("a", "a.x", 2), ProgressReport("a", 7, 5.0),
        HealthVerdict("a", Health.HEALTHY, ""), PeerReachability("a", frozenset({"b"})),
        HealthVerdict("a", Health.HEALTHY, ""),
        NodeRegistered("z", "z.x", 2), Drain("z"), Drain("a", "by its agent"), Uncordon("a"), CheckpointCommitted(5),
        LeaseLost("z"), Uncordon("z"),
    ]


def test_an_agent_that_stops_draining_stays_out_while_an_operator_holds_it() -> None:
    feed = Feed(KEYS)
    feed.snapshot([], 1)
    events = feed.convert([
        _put(KEYS.node("a"), _node("a")), _put(KEYS.cordon("a"), codec.encode_cordon("a", Hold.CORDON, "", "", 0)),
        _put(KEYS.node("a"), _node("a", draining=True)), _put(KEYS.node("a"), _node("a")),
    ])
    assert events == [NodeRegistered("a", "a.x", 2), Cordon("a"), Drain("a", "by its agent")]


def test_a_drain_hold_says_who_set_it() -> None:
    """An operator's hold reads "by operator"; the daemon's own (a straggler excluded at a
    checkpoint) names the daemon and its reason, which becomes the round's reason."""
    feed = Feed(KEYS)
    feed.snapshot([], 1)
    events = feed.convert([
        _put(KEYS.node("a"), _node("a")), _put(KEYS.node("b"), _node("b")),
        _put(KEYS.cordon("a"), codec.encode_cordon("a", Hold.DRAIN, "maintenance", "alice", 0)),
        _put(KEYS.cordon("b"), codec.encode_cordon("b", Hold.DRAIN, "straggler: busy 0.06 s/step", "daemon d0", 0)),
    ])
    assert events[2:] == [Drain("a", "by operator"), Drain("b", "by daemon d0 (straggler: busy 0.06 s/step)")]


# --- restore on take-over -----------------------------------------------------------------------


def test_restored_quarantine_holds_a_node_that_registers_later() -> None:
    machine = RoundMachine.resume(RoundPolicy(quarantine_faults=2, quarantine_window=100.0), None, 3, None, 1000.0)
    machine.restore_node("q", [5.0, 500.0], quarantined=True)  # 500 s ago is outside the window
    machine.restore_node("f", [5.0], quarantined=False)
    st = machine.state
    assert st.nodes["q"].state is NodeState.QUARANTINED and st.nodes["q"].faults == [995.0]
    assert not st.fault_changes
    decisions = machine.handle_batch([NodeRegistered("q", "q", 1), NodeRegistered("f", "f", 1)], 1001.0)
    opened = [d for d in decisions if isinstance(d, OpenRound)]
    assert opened and [m.node_id for m in opened[0].members] == ["f"] and opened[0].number == 4
    machine.handle(LeaseLost("f"), 1002.0)  # f's second fault within the window: quarantined now
    assert st.nodes["f"].state is NodeState.QUARANTINED and "f" in st.fault_changes
    st.fault_changes.clear()
    reopened = machine.handle(Uncordon("q"), 1003.0)  # the round closed when f left; q reopens it
    assert [m.node_id for d in reopened if isinstance(d, OpenRound) for m in d.members] == ["q"]
    assert st.nodes["q"].faults == [] and "q" in st.fault_changes


def test_a_member_quarantined_before_take_over_leaves_at_the_next_batch() -> None:
    current = OpenRound(7, (Member(0, "a", "a", 1), Member(1, "b", "b", 1)), 2, "a", 29500, None, "")
    machine = RoundMachine.resume(RoundPolicy(), current, 7, None, 10.0)
    machine.restore_node("b", [1.0], quarantined=True)
    decisions = machine.handle_batch([NodeRegistered("a", "a", 1), NodeRegistered("b", "b", 1)], 11.0)
    opened = [d for d in decisions if isinstance(d, OpenRound)]
    assert opened and opened[0].number == 8 and [m.node_id for m in opened[0].members] == ["a"]


# --- systemd ------------------------------------------------------------------------------------


def _listener(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    return sock


def test_notify_ready_watchdog_and_never_blocking(tmp_path: Path) -> None:
    sock = _listener(tmp_path / "n.sock")
    try:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock"), "WATCHDOG_USEC": "60000000"})
        assert notifier.enabled and notifier.watchdog_interval == 30.0
        notifier.ready("standby")
        assert sock.recv(4096) == b"READY=1\nSTATUS=standby"
        notifier.watchdog()
        notifier.watchdog()  # rate-limited: at most one per interval
        assert sock.recv(4096) == b"WATCHDOG=1"
        started = time.monotonic()
        results = [notifier.notify("STATUS=x") for _ in range(500)]  # nobody reads: the queue fills
        assert time.monotonic() - started < 5 and not all(results)
        notifier.close()
    finally:
        sock.close()


def test_notify_abstract_socket_and_absent_systemd() -> None:
    name = f"stalwart-test-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1", "WATCHDOG_PID": "1"})
        assert notifier.watchdog_interval is None  # the watchdog is for another process
        notifier.stopping()
        assert sock.recv(4096) == b"STOPPING=1"
    finally:
        sock.close()
    assert not SystemdNotifier({}).notify("READY=1")


def test_a_members_lost_lease_asks_whether_its_host_still_answers() -> None:
    asked: list[str] = []
    feed = Feed(KEYS, host_probe=lambda address: asked.append(address) or address == "a.x:7077")
    feed.snapshot([], 1)
    feed.members, feed.round_number = frozenset({"a", "b"}), 1
    feed.convert([_put(KEYS.node(n), _node(n)) for n in ("a", "b", "z")])
    events = feed.convert([_delete(KEYS.node(n)) for n in ("a", "b", "z")])
    assert events == [LeaseLost("a", host_up=True), LeaseLost("b"), LeaseLost("z")]
    assert asked == ["a.x:7077", "b.x:7077"]  # not asked for a node outside the world


def test_a_lost_peer_report_is_confirmed_by_probing_the_accused_agents() -> None:
    from stalwart.daemon.round_events import PeersLost

    asked: list[str] = []
    feed = Feed(KEYS, agent_probe=lambda address: asked.append(address) or address == "b.x:7077")
    feed.snapshot([], 1)
    feed.members, feed.round_number = frozenset({"a", "b", "c"}), 1
    feed.convert([_put(KEYS.node(n), _node(n)) for n in ("a", "b", "c")])
    report = records_pb2.HealthRecord(node_id="c", lost_peers=["a", "b"],
                                      lost_peers_round=1).SerializeToString()
    events = [e for e in feed.convert([_put(KEYS.health("c"), report)]) if isinstance(e, PeersLost)]
    assert events == [PeersLost("c", 1, frozenset({"a", "b"}), confirmed=frozenset({"a"}))]  # b's agent answers
    assert sorted(asked) == ["a.x:7077", "b.x:7077"]


def _answers(probe: object) -> tuple[bool, bool, bool]:
    """What ``probe`` says of a listening port, a refusing one and garbage."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        accepted = probe(f"127.0.0.1:{listening.getsockname()[1]}")  # type: ignore[operator]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
    return accepted, probe(f"127.0.0.1:{refused}"), probe("not an address")  # type: ignore[operator]


def test_agent_answers_only_when_the_port_accepts() -> None:
    from stalwart.daemon.loop import agent_answers

    assert _answers(agent_answers) == (True, False, False)


def test_host_answers_for_a_listening_or_refusing_host_and_not_for_garbage() -> None:
    # (A host that does not answer at all, a cut link, is the chaos network-cut fault's case.)
    # A refused connection: the agent is gone, the host is up.
    from stalwart.daemon.loop import host_answers

    assert _answers(host_answers) == (True, True, False)


def test_a_standby_asks_the_host_of_a_member_without_a_node_key_from_the_round_record() -> None:
    asked: list[str] = []
    feed = Feed(KEYS, host_probe=lambda address: asked.append(address) or True)
    snap = feed.snapshot([_kv(KEYS.round, codec.encode_round(OPEN, {}, "d1", 1.0), rev=7),
                          _kv(KEYS.node("a"), _node("a"))], 42)
    missing = sorted({m.node_id for m in OPEN.members} - {"a"})
    assert [e for e in snap.events if isinstance(e, LeaseLost)] == [LeaseLost(m, host_up=True) for m in missing]
    assert asked == [m.address for m in OPEN.members if m.node_id in missing]
