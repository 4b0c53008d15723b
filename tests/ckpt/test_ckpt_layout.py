"""Layout planning without I/O: many ranks simulated in one process."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.ckpt.errors import LayoutMismatch
from stalwart.ckpt.layout import (
    Box,
    Region,
    SavedPart,
    apply_copies,
    chunk_bounds,
    coverage_problem,
    decompose,
    intersect,
    plan_reads,
    split_evenly,
)

shapes = st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple)


def _flat_index(shape, index):
    flat = 0
    for d, i in zip(shape, index, strict=True):
        flat = flat * d + i
    return flat


@given(shape=shapes, data=st.data())
def test_decompose_yields_the_range_in_order(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = decompose(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    positions = []
    for box in boxes:
        ranges = [torch.arange(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True)]
        for index in torch.cartesian_prod(*ranges).reshape(-1, len(shape)).tolist() if shape else [[]]:
            positions.append(_flat_index(shape, index))
    assert positions == list(range(start, stop))


def test_intersect():
    assert intersect(Box((0, 0), (4, 4)), Box((2, 3), (5, 5))) == Box((2, 3), (2, 1))
    assert intersect(Box((0,), (4,)), Box((4,), (1,))) is None


def _schemes(shape, world, draw):
    """Random partition of a tensor into regions: flat cuts or boxes along one dim."""
    numel = math.prod(shape)
    if draw(st.booleans()) or not shape:
        cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=world - 1, max_size=world - 1)))
        bounds = [0, *cuts, numel]
        return [Region.flat_range(shape, a, b) for a, b in itertools.pairwise(bounds)]
    dim = draw(st.integers(0, len(shape) - 1))
    cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=world - 1, max_size=world - 1)))
    bounds = [0, *cuts, shape[dim]]
    out = []
    for a, b in itertools.pairwise(bounds):
        offsets = [0] * len(shape)
        lengths = list(shape)
        offsets[dim], lengths[dim] = a, b - a
        out.append(Region.box_at(shape, offsets, lengths))
    return out


def _local(full, region):
    if region.flat is not None:
        return full.reshape(-1)[region.flat[0] : region.flat[1]]
    return full[tuple(slice(o, o + n) for o, n in zip(region.box.offsets, region.box.lengths, strict=True))].reshape(-1)


@settings(max_examples=150, deadline=None)
@given(shape=shapes, data=st.data())
def test_any_world_reassembles_any_other(shape, data):
    """Save at world N, load at world M, with random cuts and chunk sizes: bitwise equal."""
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape) * 3 + 1
    saved = _schemes(shape, data.draw(st.integers(1, 5)), data.draw)
    wanted = _schemes(shape, data.draw(st.integers(1, 5)), data.draw)
    chunk_elems = data.draw(st.integers(1, 40))
    parts = [SavedPart(r, chunk_bounds(r.numel, 8, chunk_elems * 8)) for r in saved]
    for target in wanted:
        reads, covered = plan_reads(parts, target)
        assert covered == target.numel
        dst = torch.full((target.numel,), -1, dtype=torch.int64)
        for read in reads:
            lo, hi = parts[read.part].chunks[read.chunk]
            src = _local(full, parts[read.part].region)[lo:hi].contiguous()
            apply_copies(read.copies, src, dst)
        assert torch.equal(dst, _local(full, target).reshape(-1))


def test_plan_reads_only_touches_needed_chunks():
    shape = (100, 10)
    saved = [Region.flat_range(shape, 0, 500), Region.flat_range(shape, 500, 1000)]
    parts = [SavedPart(r, chunk_bounds(r.numel, 4, 40)) for r in saved]  # 10 elements per chunk
    target = Region.box_at(shape, (10, 0), (2, 10))  # elements 100..119
    reads, covered = plan_reads(parts, target)
    assert covered == 20
    assert [(r.part, r.chunk) for r in reads] == [(0, 10), (0, 11)]


def test_duplicate_parts_are_read_once():
    shape = (10,)
    full = Region.full(shape)
    parts = [SavedPart(full, [(0, 10)]), SavedPart(full, [(0, 10)])]
    reads, covered = plan_reads(parts, full)
    assert covered == 10 and len(reads) == 1


def test_coverage_problems():
    shape = (4, 4)
    halves = [Region.box_at(shape, (0, 0), (2, 4)), Region.box_at(shape, (2, 0), (2, 4))]
    assert coverage_problem(shape, halves) is None
    assert coverage_problem(shape, halves[:1]) is not None
    overlapping = [Region.box_at(shape, (0, 0), (3, 4)), Region.box_at(shape, (2, 0), (1, 4))]
    assert coverage_problem(shape, overlapping) is not None  # right volume, overlapping
    flats = [Region.flat_range(shape, 0, 10), Region.flat_range(shape, 8, 14), Region.flat_range(shape, 14, 16)]
    assert coverage_problem(shape, flats) is not None


@pytest.mark.parametrize(
    "region",
    [
        Region.flat_range((4, 4), 3, 17),
        Region.flat_range((4,), 3, 2),
        Region.box_at((4, 4), (3, 0), (2, 4)),
        Region.box_at((4, 4), (0,), (4,)),
        Region((4,)),
    ],
)
def test_invalid_regions_are_refused(region):
    with pytest.raises(LayoutMismatch):
        region.validate()


def test_split_evenly_covers_everything():
    for total in range(0, 20):
        for parts in range(1, 7):
            ranges = [split_evenly(total, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
