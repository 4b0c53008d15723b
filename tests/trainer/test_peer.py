"""Peer replicas without a process group: placement, filling from parts, and the side channel
between real listeners (push, pull, token, checksum, memory limit)."""

from __future__ import annotations

import socket

import pytest
import torch

from stalwart.ckpt import CommittedSnapshot, Region, Shard
from stalwart.trainer.peer import PeerConfig, PeerReplicas, buddies, fill_from_parts
from stalwart.trainer.peer_wire import Part, PeerError, send_header


def test_buddies_are_the_next_ranks_on_other_nodes_each_on_its_own_node() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert buddies(nodes, 0, 1) == [2]
    assert buddies(nodes, 1, 2) == [2, 4]
    assert buddies(nodes, 5, 1) == [0]
    assert buddies(nodes, 4, 5) == [0, 2]  # only two other nodes
    assert buddies(["a", "a"], 0, 1) == []
    # Every rank's buddy is on another node: losing any one node leaves a copy of each of its ranks.
    for r in range(len(nodes)):
        assert all(nodes[b] != nodes[r] for b in buddies(nodes, r, 1))


def _flat_part(rank: int, step: int, full: torch.Tensor, start: int, stop: int) -> Part:
    return Part(step, rank, {"w": (Region.flat_range(full.shape, start, stop), full.view(-1)[start:stop].clone())})


def test_parts_fill_a_range_that_spans_them_in_any_order_and_leave_the_rest() -> None:
    full = torch.arange(12, dtype=torch.float32)
    parts = [_flat_part(2, 6, full, 7, 12), _flat_part(0, 6, full, 0, 4), _flat_part(1, 6, full, 4, 7)]
    target = torch.zeros(10)
    rest, copied = fill_from_parts({"w": Shard.flat(target, (12,), 0)}, parts)
    assert rest == {} and torch.equal(target, full[:10])
    assert copied == {0: 16, 1: 12, 2: 12}
    # A part strictly inside the range: the range stays whole for storage (the loader reads one
    # region per name); one at its end shrinks it to the rest.
    target = torch.zeros(10)
    rest, copied = fill_from_parts({"w": Shard.flat(target, (12,), 0)}, [parts[2]])
    assert rest["w"].region.flat == (0, 10) and copied == {}
    rest, copied = fill_from_parts({"w": Shard.flat(target, (12,), 0)}, [parts[0], parts[2]])
    assert rest["w"].region.flat == (0, 7) and copied == {2: 12} and torch.equal(target[7:], full[7:10])
    # A replicated tensor written whole by one rank.
    b = torch.randn(3, 4)
    dst = torch.zeros(3, 4)
    rest, copied = fill_from_parts({"buf": dst}, [Part(6, 0, {"buf": (Region.full((3, 4)), b.view(-1))})])
    assert rest == {} and torch.equal(dst, b) and copied == {0: 48}


class _Saved:
    """What ``replicate`` reads of a save: its snapshot, complete."""

    def __init__(self, snapshot: CommittedSnapshot) -> None:
        self.snapshot = snapshot

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        return True

    def host_copy(self) -> CommittedSnapshot:
        return self.snapshot


def _world(stores: list[PeerReplicas], nodes: list[str], token: str = "t0k3n") -> None:
    everyone = [{"node": n, "host": "127.0.0.1", "port": s.port, "token": token if i == 0 else ""}
                for i, (s, n) in enumerate(zip(stores, nodes, strict=True))]
    for rank, s in enumerate(stores):
        s.join(everyone, rank)


def _snapshot(step: int, rank: int) -> tuple[CommittedSnapshot, torch.Tensor]:
    torch.manual_seed(step * 10 + rank)
    w = torch.randn(1000)
    h = torch.randn(7).to(torch.bfloat16)  # an odd size before a float32: the payload stays aligned
    snap = CommittedSnapshot(step, {"h": (Region.flat_range((7,), 0, 7), h),
                                    "w": (Region.flat_range((3000,), rank * 1000, rank * 1000 + 1000), w)})
    return snap, w


@pytest.fixture
def three() -> list[PeerReplicas]:
    stores = [PeerReplicas(PeerConfig(timeout_s=10)) for _ in range(3)]
    _world(stores, ["n0", "n1", "n2"])
    yield stores  # type: ignore[misc]
    for s in stores:
        s.close()


def test_a_pushed_part_is_held_by_the_buddy_and_pulled_bitwise_by_another_rank(three: list[PeerReplicas]) -> None:
    a, b, c = three
    snap, w = _snapshot(6, 0)
    a.replicate(_Saved(snap), 0)  # type: ignore[arg-type]
    assert a.wait_pushed(6, 10)
    assert [p.rank for p in b.holdings()] == [0] and b.held_bytes == 1000 * 4 + 7 * 2
    peers = list(c._peers)  # noqa: SLF001
    got = c._pull(peers[1], "t0k3n", 6, 0, ["w"])  # noqa: SLF001 - c pulls rank 0's part from its buddy
    assert list(got.tensors) == ["w"] and torch.equal(got.tensors["w"][1], w)
    # A newer save's part arrives after its snapshot, before its commit: the buddy keeps both
    # until it sees step 7 committed (then the older one is of no use to a restore).
    snap7, w7 = _snapshot(7, 0)
    a.replicate(_Saved(snap7), 0)  # type: ignore[arg-type]
    assert a.wait_pushed(7, 10)
    assert sorted((p.step, p.rank) for p in b.holdings()) == [(6, 0), (7, 0)]
    b.keep_own(_snapshot(7, 1)[0], 1)
    assert sorted((p.step, p.rank) for p in b.holdings()) == [(7, 0), (7, 1)]
    with pytest.raises(PeerError, match="no part of rank 0 at step 6"):
        c._pull(peers[1], "t0k3n", 6, 0, [])  # noqa: SLF001
    assert torch.equal(c._pull(peers[1], "t0k3n", 7, 0, ["w"]).tensors["w"][1], w7)  # noqa: SLF001


def test_a_request_without_the_worlds_token_is_refused(three: list[PeerReplicas]) -> None:
    a, b, _ = three
    a.replicate(_Saved(_snapshot(6, 0)[0]), 0)  # type: ignore[arg-type]
    assert a.wait_pushed(6, 10)
    with pytest.raises(PeerError, match="wrong token"):
        a._pull(("127.0.0.1", b.port), "not-the-token", 6, 0, [])  # noqa: SLF001
    with socket.create_connection(("127.0.0.1", b.port)) as s:
        send_header(s, {"op": "put", "token": "guess", "step": 9, "rank": 2, "entries": [], "size": 0,
                         "digest": ""})
        s.recv(1024)
    assert [p.step for p in b.holdings()] == [6]


def test_a_corrupt_payload_and_one_over_the_memory_limit_are_not_kept() -> None:
    small = PeerReplicas(PeerConfig(memory_limit_bytes=1000, timeout_s=10))
    sender = PeerReplicas(PeerConfig(timeout_s=10))
    try:
        _world([sender, small], ["n0", "n1"])
        sender.replicate(_Saved(_snapshot(6, 0)[0]), 0)  # type: ignore[arg-type]
        assert not sender.wait_pushed(6, 10)
        assert small.holdings() == [] and "memory limit" in sender.failed[-1]["error"]
        # A payload whose bytes do not match its checksum (as if changed on the way).
        with socket.create_connection(("127.0.0.1", small.port)) as s:
            send_header(s, {"op": "put", "token": "t0k3n", "step": 6, "rank": 0, "size": 64, "digest": "0" * 16,
                             "entries": [{"name": "x", "region": {"flat": [0, 16]}, "shape": [16],
                                          "dtype": "torch.float32", "numel": 16, "offset": 0, "nbytes": 64}]})
            s.sendall(bytes(64))
            s.shutdown(socket.SHUT_WR)
            s.recv(1024)
        assert small.holdings() == []
    finally:
        small.close()
        sender.close()


def test_a_pull_from_a_holder_that_stops_answering_gives_up_within_the_pull_timeout() -> None:
    """A restore's pull is on the critical path: a holder whose link was cut after it said what it
    holds must not hold the restore up (the part is then read from storage). The push timeout is
    an hour here: a pull that waited by it would run into the test's own timeout."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    store = PeerReplicas(PeerConfig(pull_timeout_s=0.5, timeout_s=3600.0))
    try:
        with pytest.raises(OSError):
            store._pull(("127.0.0.1", silent.getsockname()[1]), "t", 6, 0, [])  # noqa: SLF001
    finally:
        store.close()
        silent.close()
