"""A node's straggling ranks: slower than the median of the node's other ranks."""

from __future__ import annotations

from stalwart.agent.stragglers import slower_than_others


def test_slower_than_others_compares_with_the_others_median() -> None:
    assert slower_than_others({"a": 1.0, "b": 1.0, "c": 1.6}, 1.5) == ["c"]
    assert slower_than_others({"a": 1.0, "b": 1.0, "c": 1.5}, 1.5) == []  # not strictly over
    assert slower_than_others({"a": 1.0, "b": 2.1}, 2.0) == ["b"]  # two ranks: still decidable
    assert slower_than_others({"a": 1.0, "b": 0.0, "c": 5.0}, 1.5) == ["c"]  # unknown (0) left out
    assert slower_than_others({"a": 1.0}, 1.5) == []
