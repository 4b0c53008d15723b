"""Local stragglers: which of a node's ranks is slower than its other ranks. Pure logic.

The agent marks a rank as straggling when its recent busy time (wall step time minus time
blocked in collectives) exceeds ``factor`` × the median of the node's *other* ranks. The
daemon judges whole nodes the same way, across nodes and over consecutive reports
(``stalwart.daemon.stragglers``); the two are separate components and share no code.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["slower_than_others"]

K = TypeVar("K")


def slower_than_others(busy: Mapping[K, float], factor: float) -> list[K]:
    """Keys whose value exceeds ``factor`` × the median of the other keys' values.

    Values that are not positive (unknown) are left out on both sides; with fewer than two
    known values nothing can be compared and the answer is empty. O(n log n): one sort, then
    each key's "median of the others" is read from the ranks either side of its own.
    """
    known = {k: v for k, v in busy.items() if v > 0}
    if len(known) < 2:
        return []
    ordered = sorted(known.values())
    n = len(ordered) - 1
    half = n // 2
    out = []
    for key, value in known.items():
        cut = bisect.bisect_left(ordered, value)

        def at(i: int, cut: int = cut) -> float:
            return ordered[i] if i < cut else ordered[i + 1]

        median = at(half) if n % 2 else (at(half - 1) + at(half)) / 2
        if value > factor * median:
            out.append(key)
    return out
