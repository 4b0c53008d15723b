"""Layout planning: which elements of which saved chunk land where in a rank's part. No I/O.

A tensor is saved by one or more ranks, each holding a :class:`Region` of it: either a contiguous
range of the flattened tensor (how ZeRO partitions a flat parameter group) or a box of offsets and
lengths per dimension (how tensor parallelism slices a weight). A rank stores its region's
elements in its own row-major order, cut into chunks of whole elements.

Everything here reduces to one primitive: a :class:`Piece` is a box of the *global* tensor whose
elements are consecutive in some local buffer. Any contiguous run of a region's local elements
splits into at most ``2 * ndim - 1`` pieces (:func:`decompose`), and moving data between two
pieces whose boxes intersect is one strided tensor copy. So a loader at any world size plans its
reads by intersecting the pieces of every saved chunk with the pieces of the part it wants, and
the planning can be tested by simulating any number of ranks in one process.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from stalwart.ckpt.errors import LayoutMismatch

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """A box of a tensor: ``offsets[d] <= index[d] < offsets[d] + lengths[d]`` for every dim."""

    offsets: Shape
    lengths: Shape

    @property
    def volume(self) -> int:
        return math.prod(self.lengths)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or ``None`` when they share no element."""
    offsets = []
    lengths = []
    for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True):
        lo = max(ao, bo)
        hi = min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def decompose(shape: Shape, start: int, stop: int) -> list[Box]:
    """Split the flat range ``[start, stop)`` of a row-major array of ``shape`` into boxes.

    The boxes come in order and each is contiguous in row-major order, so their elements are the
    range's elements, consecutively. At most ``2 * len(shape) - 1`` boxes are returned.
    """
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    if len(shape) == 1:
        return [Box((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)
    out: list[Box] = []
    row = start // inner
    if start % inner:
        end = min(stop, (row + 1) * inner)
        for box in decompose(shape[1:], start - row * inner, end - row * inner):
            out.append(Box((row, *box.offsets), (1, *box.lengths)))
        start = end
        row += 1
    full_rows = stop // inner - row
    if start < stop and full_rows > 0:
        out.append(Box((row, *rest), (full_rows, *shape[1:])))
        start += full_rows * inner
        row += full_rows
    if start < stop:
        for box in decompose(shape[1:], 0, stop - row * inner):
            out.append(Box((row, *box.offsets), (1, *box.lengths)))
    return out


@dataclass(frozen=True)
class Piece:
    """A global box whose elements sit, row-major, at ``[start, start + box.volume)`` of a buffer."""

    box: Box
    start: int


@dataclass(frozen=True)
class Region:
    """The part of a tensor of global ``shape`` that one rank holds.

    Exactly one of ``flat`` (``[start, stop)`` of the flattened tensor) and ``box`` is set. Build
    one with :meth:`full`, :meth:`flat_range` or :meth:`box_at`; :meth:`validate` checks bounds.
    """

    shape: Shape
    flat: tuple[int, int] | None = None
    box: Box | None = None

    @classmethod
    def full(cls, shape: Sequence[int]) -> Region:
        shape = tuple(int(d) for d in shape)
        return cls(shape, box=Box((0,) * len(shape), shape))

    @classmethod
    def flat_range(cls, shape: Sequence[int], start: int, stop: int) -> Region:
        return cls(tuple(int(d) for d in shape), flat=(int(start), int(stop)))

    @classmethod
    def box_at(cls, shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> Region:
        box = Box(tuple(int(o) for o in offsets), tuple(int(n) for n in lengths))
        return cls(tuple(int(d) for d in shape), box=box)

    @property
    def numel(self) -> int:
        """Number of elements this region holds."""
        if self.flat is not None:
            return self.flat[1] - self.flat[0]
        assert self.box is not None
        return self.box.volume

    @property
    def local_shape(self) -> Shape:
        """The shape of the local data: the box's lengths, or one dimension for a flat range."""
        if self.flat is not None:
            return (self.numel,)
        assert self.box is not None
        return self.box.lengths

    def validate(self) -> None:
        """Raise :class:`LayoutMismatch` unless the region lies inside the global shape."""
        if any(d < 0 for d in self.shape):
            raise LayoutMismatch(f"negative dimension in shape {self.shape}")
        if (self.flat is None) == (self.box is None):
            raise LayoutMismatch("a region is either a flat range or a box, exactly one of them")
        if self.flat is not None:
            start, stop = self.flat
            if not 0 <= start <= stop <= math.prod(self.shape):
                raise LayoutMismatch(f"flat range {self.flat} outside a tensor of shape {self.shape}")
            return
        assert self.box is not None
        if not len(self.box.offsets) == len(self.box.lengths) == len(self.shape):
            raise LayoutMismatch(f"box {self.box} does not have the {len(self.shape)} dims of {self.shape}")
        for o, n, d in zip(self.box.offsets, self.box.lengths, self.shape, strict=True):
            if o < 0 or n < 0 or o + n > d:
                raise LayoutMismatch(f"box {self.box} outside a tensor of shape {self.shape}")

    def pieces(self, start: int = 0, stop: int | None = None) -> list[Piece]:
        """The pieces of this region's local elements ``[start, stop)``; positions are local."""
        stop = self.numel if stop is None else stop
        if self.flat is not None:
            boxes = decompose(self.shape, self.flat[0] + start, self.flat[0] + stop)
        else:
            assert self.box is not None
            origin = self.box.offsets
            boxes = [
                Box(tuple(o + b for o, b in zip(origin, box.offsets, strict=True)), box.lengths)
                for box in decompose(self.box.lengths, start, stop)
            ]
        out = []
        pos = start
        for box in boxes:
            out.append(Piece(box, pos))
            pos += box.volume
        return out

    def key(self) -> tuple[object, ...]:
        """Identity of the covered elements *and* their local order (for de-duplication)."""
        return (self.flat, self.box)

    def to_json(self) -> dict[str, list[int]]:
        if self.flat is not None:
            return {"flat": list(self.flat)}
        assert self.box is not None
        return {"offsets": list(self.box.offsets), "lengths": list(self.box.lengths)}

    @classmethod
    def from_json(cls, shape: Sequence[int], obj: object) -> Region:
        """Parse :meth:`to_json` output; raises ``ValueError``/``TypeError`` on a malformed value."""
        if not isinstance(obj, dict):
            raise TypeError("region must be an object")
        if "flat" in obj:
            start, stop = obj["flat"]
            region = cls.flat_range(shape, _int(start), _int(stop))
        else:
            region = cls.box_at(shape, [_int(o) for o in obj["offsets"]], [_int(n) for n in obj["lengths"]])
        return region


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def chunk_bounds(numel: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Cut ``numel`` local elements into chunks of at most ``chunk_bytes`` (at least one element)."""
    per_chunk = max(1, chunk_bytes // max(1, itemsize))
    return [(lo, min(lo + per_chunk, numel)) for lo in range(0, numel, per_chunk)]


@dataclass(frozen=True)
class Copy:
    """Move the intersection of two pieces: ``dst[dst_index] = src[src_index]``.

    ``src_start``/``dst_start`` are element positions in the source chunk and the destination
    buffer; ``*_shape`` is the piece's box shape there and ``*_index`` the slices inside it.
    """

    src_start: int
    src_shape: Shape
    src_index: tuple[slice, ...]
    dst_start: int
    dst_shape: Shape
    dst_index: tuple[slice, ...]
    numel: int


def plan_copies(src: Iterable[Piece], dst: Sequence[Piece], src_base: int = 0) -> list[Copy]:
    """Every copy from ``src`` pieces into ``dst`` pieces; ``src_base`` is subtracted from sources."""
    copies = []
    for sp in src:
        for dp in dst:
            common = intersect(sp.box, dp.box)
            if common is None:
                continue
            copies.append(
                Copy(
                    src_start=sp.start - src_base,
                    src_shape=sp.box.lengths,
                    src_index=_slices(common, sp.box),
                    dst_start=dp.start,
                    dst_shape=dp.box.lengths,
                    dst_index=_slices(common, dp.box),
                    numel=common.volume,
                )
            )
    return copies


def _slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(
        slice(io - oo, io - oo + n) for io, n, oo in zip(inner.offsets, inner.lengths, outer.offsets, strict=True)
    )


def apply_copies(copies: Iterable[Copy], src: torch.Tensor, dst: torch.Tensor) -> int:
    """Run ``copies`` from the 1-D tensor ``src`` into the 1-D tensor ``dst``; returns elements moved.

    Copies write disjoint elements of ``dst`` when the saved regions are disjoint, so several
    threads may apply copies into the same ``dst`` at once.
    """
    moved = 0
    for c in copies:
        s = src[c.src_start : c.src_start + math.prod(c.src_shape)].view(c.src_shape)[c.src_index]
        d = dst[c.dst_start : c.dst_start + math.prod(c.dst_shape)].view(c.dst_shape)[c.dst_index]
        d.copy_(s)
        moved += c.numel
    return moved


@dataclass(frozen=True)
class SavedPart:
    """One rank's saved region of a tensor and the local element bounds of its chunks."""

    region: Region
    chunks: Sequence[tuple[int, int]]


@dataclass(frozen=True)
class ChunkRead:
    """Read chunk ``chunk`` of saved part ``part`` and apply ``copies`` to the destination."""

    part: int
    chunk: int
    copies: list[Copy]


def plan_reads(parts: Sequence[SavedPart], target: Region) -> tuple[list[ChunkRead], int]:
    """Which chunks of ``parts`` a rank needs to fill ``target``, and how many elements they give.

    Parts that cover the same elements in the same order (a tensor saved by several ranks) are
    read once. The second value equals ``target.numel`` exactly when the parts cover the target
    once; the loader treats anything else as a corrupt checkpoint.
    """
    dst = target.pieces()
    reads: list[ChunkRead] = []
    covered = 0
    seen: set[tuple[object, ...]] = set()
    for index, part in enumerate(parts):
        key = part.region.key()
        if key in seen:
            continue
        seen.add(key)
        if not plan_copies(part.region.pieces(), dst):
            continue
        for chunk_index, (lo, hi) in enumerate(part.chunks):
            copies = plan_copies(part.region.pieces(lo, hi), dst, src_base=lo)
            if copies:
                reads.append(ChunkRead(index, chunk_index, copies))
                covered += sum(c.numel for c in copies)
    return reads, covered


def coverage_problem(shape: Shape, regions: Sequence[Region]) -> str | None:
    """Why ``regions`` do not tile a tensor of ``shape`` exactly once, or ``None`` when they do.

    Identical regions (the same data saved by several ranks) count once. Exact for any mix of
    flat ranges and boxes: given the volumes add up, the regions tile the tensor exactly when no
    two overlap. Flat ranges alone are checked by sorting; otherwise every region is cut into
    boxes and a sweep along the dimension with the most distinct offsets compares only boxes
    whose extents there overlap. Regions are assumed inside the shape (``Region.validate``).
    """
    unique = [r for r in {r.key(): r for r in regions}.values() if r.numel]
    total = sum(r.numel for r in unique)
    numel = math.prod(shape)
    if total != numel:
        return f"parts hold {total} elements of a tensor of {numel}"
    if all(r.flat is not None for r in unique):
        flats = sorted(r.flat for r in unique if r.flat is not None)
        for (_, stop), (start, _) in itertools.pairwise(flats):
            if start < stop:
                return f"flat ranges overlap at element {start}"
        return None
    boxes = [p.box for r in unique for p in r.pieces()]
    if not shape:
        return "parts overlap in the scalar" if len(boxes) > 1 else None
    dim = max(range(len(shape)), key=lambda d: len({b.offsets[d] for b in boxes}))
    boxes.sort(key=lambda b: b.offsets[dim])
    active: list[Box] = []
    for box in boxes:
        start = box.offsets[dim]
        active = [a for a in active if a.offsets[dim] + a.lengths[dim] > start]
        for other in active:
            common = intersect(box, other)
            if common is not None:
                return f"parts overlap in box {common}"
        active.append(box)
    return None


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``total`` items are split into ``parts`` nearly equal
    ranges (the first ``total % parts`` ranges get one more item)."""
    if parts <= 0 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} does not exist")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)
