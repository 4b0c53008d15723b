"""Memory generations without a process group: which generation a restore may take, the
lineage rule over real listeners, and a fill whose holder is gone (``trainer/generations.py``)."""

from __future__ import annotations

import time

import pytest
import torch

from stalwart.ckpt import Region, Shard, encode_metadata
from stalwart.trainer.generations import Generation, MemoryStore, choose_generation, fill_generation
from stalwart.trainer.peer import PeerConfig, PeerFill, PeerReplicas
from stalwart.trainer.peer_wire import Part, entries


def _part(step: int, rank: int, tag: str, world: int = 3, size: int = 4) -> Part:
    full = torch.arange(world * size, dtype=torch.float32) + step * 100
    lo, hi = rank * size, (rank + 1) * size
    meta = encode_metadata({"trainer": {"step": step, "from": rank}, "rng": {"seed": bytes([rank, step])}})
    return Part(step, rank, {"w": (Region.flat_range((world * size,), lo, hi), full[lo:hi].clone())},
                tag=tag, world=world, meta=meta)


def _report(lineage: str, *parts: Part) -> dict[str, object]:
    return {"lineage": lineage, "parts": [p.summary() for p in parts]}


def test_the_newest_generation_with_a_part_of_every_rank_is_chosen_and_only_above_the_commit() -> None:
    a = "lineage-a"
    reports = [_report(a, _part(8, 0, a), _part(7, 0, a), _part(8, 2, a), _part(7, 2, a)),
               _report(a, _part(8, 1, a), _part(7, 1, a)),
               _report("")]  # a fresh process (a spare): it knows no lineage and holds nothing
    assert choose_generation(reports, 6) == Generation(a, 8, 3)
    assert choose_generation(reports, 8) is None  # storage holds step 8 already
    assert choose_generation(reports, 6, at_most=7) == Generation(a, 7, 3)  # a rollback of a fault at step 8
    assert choose_generation(reports, 7, at_most=7) is None
    # Rank 2's part of step 8 lost (not pushed yet when its node died): step 7 is whole.
    reports[0] = _report(a, _part(8, 0, a), _part(7, 0, a), _part(7, 2, a))
    assert choose_generation(reports, 6) == Generation(a, 7, 3)
    reports[0] = _report(a, _part(8, 0, a))
    assert choose_generation(reports, 6) is None


def test_parts_of_two_lineages_are_never_combined() -> None:
    a, b = "lineage-a", "lineage-b"
    # Each step is covered only by mixing the two: no generation may be taken.
    mixed = [_report(a, _part(8, 0, a), _part(8, 2, b)), _report(a, _part(8, 1, a))]
    assert choose_generation(mixed, 0) is None
    # Ranks that disagree on the lineage (a restore finished on some of them only): none at all,
    # even where one lineage alone would be complete.
    disagree = [_report(a, _part(8, 0, a), _part(8, 1, a), _part(8, 2, a)), _report(b)]
    assert choose_generation(disagree, 0) is None
    # A store keeps only its lineage's parts, and a restore's new lineage drops the old ones.
    store = MemoryStore()
    store.reset(a)
    assert store.accept(_part(8, 1, a)) is None
    assert "lineage" in str(store.accept(_part(9, 1, b)))
    assert not store.keep_own(_part(9, 0, b))
    store.reset(b)
    assert store.report() == {"lineage": b, "parts": []}


def test_a_store_keeps_the_newest_two_generations_above_the_last_commit() -> None:
    store = MemoryStore()
    store.reset("t")
    for step in (4, 5, 7):
        assert store.keep_own(_part(step, 0, "t"))
        assert store.accept(_part(step, 1, "t")) is None
    assert sorted((s["step"], s["rank"]) for s in store.report()["parts"]) == [(5, 0), (5, 1), (7, 0), (7, 1)]
    store.committed(6)
    assert sorted(s["step"] for s in store.report()["parts"]) == [7, 7]
    assert "stale" in str(store.accept(_part(6, 1, "t")))


def _world(stores: list[PeerReplicas], nodes: list[str]) -> None:
    everyone = [{"node": n, "host": "127.0.0.1", "port": s.port, "token": "t0k3n" if i == 0 else ""}
                for i, (s, n) in enumerate(zip(stores, nodes, strict=True))]
    for rank, s in enumerate(stores):
        s.join(everyone, rank)
        s.memory.reset("a")


@pytest.fixture
def three() -> list[PeerReplicas]:
    stores = [PeerReplicas(PeerConfig(timeout_s=10, pull_timeout_s=2)) for _ in range(3)]
    _world(stores, ["n0", "n1", "n2"])
    yield stores  # type: ignore[misc]
    for s in stores:
        s.close()


def _pushed(store: PeerReplicas, step: int) -> None:
    deadline = time.monotonic() + 30
    while not any(e["step"] == step and e["memory"] for e in store.pushed):
        assert time.monotonic() < deadline and not store.failed, store.failed
        time.sleep(0.01)


def test_a_rank_fills_its_targets_from_its_part_and_parts_pulled_from_the_holders(three: list[PeerReplicas]) -> None:
    for rank, store in enumerate(three):
        store.keep_generation(_part(8, rank, "a"))
        _pushed(store, 8)
    reports = [s.memory.report() for s in three]
    gen = choose_generation(reports, 6)
    assert gen == Generation("a", 8, 3)
    # World 3 -> 2 (rank 2 lost): the new rank 1 owns elements 6..12, half of them rank 2's.
    a, b, _ = three
    target = torch.zeros(6)
    rest, got = fill_generation(b.memory, b.pull_generation, gen, reports[:2] + [{"lineage": "a", "parts": []}], 1,
                                {"w": Shard.flat(target, (12,), 6)})
    assert rest == {} and got is not None
    assert torch.equal(target, torch.arange(6, 12, dtype=torch.float32) + 800)
    assert got.rng == {"seed": bytes([1, 8])} and got.trainer_meta == {"step": 8, "from": 0}
    assert got.fill == PeerFill(own_bytes=8, held_bytes=0, pulled_bytes=16, pulled={2: 0})
    # A part pulled from another lineage's tag finds nothing.
    with pytest.raises(Exception, match="no part of rank 2 at step 8"):
        b.pull_generation(0, 2, Generation("b", 8, 3), ["w"])


def test_a_fill_whose_holder_is_gone_is_incomplete_so_the_world_reads_storage(three: list[PeerReplicas]) -> None:
    for rank, store in enumerate(three):
        store.keep_generation(_part(8, rank, "a"))
        _pushed(store, 8)
    reports = [s.memory.report() for s in three]
    gen = choose_generation(reports, 6)
    assert gen is not None
    a, b, c = three
    a.close()  # it said what it holds, then died: rank 2's part (held only by rank 0) is out of reach
    target = torch.zeros(6)
    rest, got = fill_generation(b.memory, b.pull_generation, gen, reports, 1, {"w": Shard.flat(target, (12,), 6)})
    assert got is None and list(rest) == ["w"]


def test_a_new_lineage_takes_generations_below_a_commit_the_old_one_saw() -> None:
    """A storage restore may go back below a commit the store saw (the newer step was corrupt
    and set aside): the steps after it are trained again, and their generations are wanted."""
    store = MemoryStore()
    store.reset("a")
    store.committed(9)
    assert not store.keep_own(_part(8, 0, "a"))
    store.reset("b")
    assert store.keep_own(_part(8, 0, "b")) and store.accept(_part(8, 1, "b")) is None


def test_a_memory_limit_sized_for_the_kept_generations_takes_each_new_one() -> None:
    """Room for two generations of one origin: the third replaces the first rather than being refused
    (the limit is checked before a part arrives, against what is held and the size on the wire)."""
    one, wire = _part(5, 0, "a").nbytes, entries(_part(5, 0, "a"))[1]
    holder = PeerReplicas(PeerConfig(timeout_s=10, memory_limit_bytes=one + wire))
    sender = PeerReplicas(PeerConfig(timeout_s=10))
    try:
        _world([sender, holder], ["n0", "n1"])
        for step in (5, 7, 9):
            sender.keep_generation(_part(step, 0, "a"))
            _pushed(sender, step)
        assert sorted(s["step"] for s in holder.memory.report()["parts"]) == [7, 9]
    finally:
        holder.close()
        sender.close()
