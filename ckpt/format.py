"""The on-disk format (see FORMAT.md): names, the shard header, the JSON manifest and its checks.

Everything read from disk is parsed here into plain dataclasses, and everything that can be wrong
with it is turned into :class:`CheckpointCorrupt`, :class:`UnsafePath` or
:class:`UnsupportedFormat` before any tensor data is touched. No pickle, no code execution: the
manifest is JSON, tensor bytes are raw or zstd, metadata is JSON with tagged byte strings.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from stalwart.ckpt.errors import CheckpointCorrupt, LayoutMismatch, UnsafePath, UnsupportedFormat
from stalwart.ckpt.layout import Region, SavedPart, Shape, coverage_problem

FORMAT_MAJOR = 1
FORMAT_MINOR = 1
MANIFEST_MAGIC = "stalwart-checkpoint"
MANIFEST_NAME = "manifest.json"
VERIFIED_NAME = "verified.json"
FENCE_NAME = "fence.json"
LOCK_NAME = ".lock"
STEP_PREFIX = "step-"
SHARD_MAGIC = b"STWSHRD\x00"
HEADER_SIZE = 64
CHUNK_HASH = "xxh3_64"
FILE_HASH = "xxh3_128"
CODECS = ("raw", "zstd")
MAX_MANIFEST_BYTES = 1 << 30
MAX_CHUNK_BYTES = 1 << 30
MAX_METADATA_DEPTH = 64
"""Nesting levels a rank's metadata may have (its own object is level 1). Deeper JSON cannot be
parsed and re-serialized without hitting Python's recursion limit, so save refuses it."""
MAX_MANIFEST_DEPTH = MAX_METADATA_DEPTH + 4  # document, content, metadata list, a rank's object

_HEADER = struct.Struct("<8sHHIIQ")  # magic, major, minor, rank, world_size, step
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
_STEP_DIR = re.compile(r"step-(\d{12})")

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def step_dir_name(step: int) -> str:
    if not 0 <= step < 10**12:
        raise ValueError(f"step must be in [0, 1e12), got {step}")
    return f"{STEP_PREFIX}{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory name, or ``None`` for any other name."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def shard_file_name(rank: int, attempt: str | None = None) -> str:
    """``rank-NNNNN.bin``, or ``rank-NNNNN-<attempt>.bin`` when that name is taken (a crashed or a
    concurrent save of the same step): a writer only ever writes a file it created itself."""
    return f"rank-{rank:05d}.bin" if attempt is None else f"rank-{rank:05d}-{attempt}.bin"


def check_name(name: object) -> str:
    """Return ``name`` if it is one plain file name inside a checkpoint directory, else raise.

    Refuses ``..``, absolute paths, separators of any platform, NUL and the reserved names.
    Raises :class:`UnsafePath`.
    """
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or name in (MANIFEST_NAME, LOCK_NAME):
        raise UnsafePath(f"file name {name!r} is not a plain name inside the checkpoint", file=MANIFEST_NAME)
    return name


def chunk_digest(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise LayoutMismatch(f"dtype {dtype} cannot be checkpointed") from None


# --- shard file header -------------------------------------------------------------------------


def pack_header(rank: int, world_size: int, step: int) -> bytes:
    body = _HEADER.pack(SHARD_MAGIC, FORMAT_MAJOR, FORMAT_MINOR, rank, world_size, step)
    body = body.ljust(HEADER_SIZE - 8, b"\x00")
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def check_header(data: bytes, *, file: str, rank: int, world_size: int, step: int) -> None:
    """Raise unless ``data`` is the intact header of ``file``, written by ``rank`` for ``step``."""
    if len(data) != HEADER_SIZE:
        raise CheckpointCorrupt("file shorter than its header", file=file)
    body, (digest,) = data[:-8], struct.unpack("<Q", data[-8:])
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise CheckpointCorrupt("header checksum mismatch", file=file)
    magic, major, _minor, h_rank, h_world, h_step = _HEADER.unpack_from(body)
    if magic != SHARD_MAGIC:
        raise CheckpointCorrupt("not a stalwart shard file", file=file)
    if major > FORMAT_MAJOR:
        raise UnsupportedFormat(f"{file}: shard format {major}.x is newer than this reader ({FORMAT_MAJOR}.x)")
    if (h_rank, h_world, h_step) != (rank, world_size, step):
        raise CheckpointCorrupt(
            f"header says rank {h_rank}/{h_world} step {h_step}, manifest says rank {rank}/{world_size} "
            f"step {step}",
            file=file,
        )


# --- metadata: JSON-safe values and byte strings -----------------------------------------------

_BYTES_TAG = "$bytes"


def encode_metadata(value: Any, path: str = "metadata", depth: int = 1) -> Any:
    """Turn metadata into JSON values: bytes become ``{"$bytes": base64}``; raises ``LayoutMismatch``
    for anything else that JSON cannot hold exactly (sets, tensors, NaN, non-string keys) and for
    nesting deeper than :data:`MAX_METADATA_DEPTH` (it could be saved but never loaded)."""
    if depth > MAX_METADATA_DEPTH:
        raise LayoutMismatch(f"{path[:200]}: metadata is nested deeper than {MAX_METADATA_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise LayoutMismatch(f"{path}: {value} cannot be stored in JSON")
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {_BYTES_TAG: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [encode_metadata(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if set(value) == {_BYTES_TAG}:
            raise LayoutMismatch(f"{path}: a dict with the single key {_BYTES_TAG!r} is reserved")
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise LayoutMismatch(f"{path}: key {key!r} is not a string")
            out[key] = encode_metadata(v, f"{path}.{key}", depth + 1)
        return out
    raise LayoutMismatch(f"{path}: {type(value).__name__} is not JSON-safe metadata (use bytes for blobs)")


def decode_metadata(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_metadata(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_BYTES_TAG}:
            return base64.b64decode(value[_BYTES_TAG], validate=True)
        return {k: decode_metadata(v) for k, v in value.items()}
    return value


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than ``limit`` levels (scalars are level 0).
    Iterative, so a hostile document cannot exhaust the stack while it is being measured."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        if depth + 1 > limit:
            return True
        stack.extend((v, depth + 1) for v in item)
    return False


# --- the manifest ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk of a shard file: where it is, how it is stored, the digest of its raw bytes."""

    offset: int
    stored: int
    raw: int
    codec: str
    digest: str

    def to_json(self) -> list[Any]:
        return [self.offset, self.stored, self.raw, self.codec, self.digest]


@dataclass(frozen=True)
class PartRecord:
    """The region of a tensor saved by one rank, and its chunks (in local element order)."""

    rank: int
    file: str
    region: Region
    chunks: tuple[ChunkRecord, ...]

    def chunk_bounds(self, itemsize: int) -> list[tuple[int, int]]:
        bounds = []
        pos = 0
        for c in self.chunks:
            bounds.append((pos, pos + c.raw // itemsize))
            pos += c.raw // itemsize
        return bounds


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: str
    shape: Shape
    parts: tuple[PartRecord, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def saved_parts(self) -> list[SavedPart]:
        return [SavedPart(p.region, p.chunk_bounds(self.itemsize)) for p in self.parts]


@dataclass(frozen=True)
class FileRecord:
    name: str
    rank: int
    size: int
    digest: str


@dataclass(frozen=True)
class Manifest:
    """A parsed, checked manifest. ``metadata[r]`` is what rank ``r`` saved next to its tensors."""

    step: int
    world_size: int
    created_unix: float
    files: dict[str, FileRecord]
    tensors: dict[str, TensorRecord]
    metadata: list[dict[str, Any]]
    version: tuple[int, int] = (FORMAT_MAJOR, FORMAT_MINOR)
    digest: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    fence: int | None = None
    """The writer's fencing token (job attempt, round), when it gave one (format 1.1)."""
    attempt: str | None = None
    """A random id of the save that committed this step (format 1.1)."""

    @property
    def logical_bytes(self) -> int:
        return sum(c.raw for t in self.tensors.values() for p in t.parts for c in p.chunks)

    @property
    def stored_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def encode_manifest(content: dict[str, Any]) -> tuple[bytes, str]:
    """The manifest file's bytes for ``content`` (see :func:`build_content`), and its digest."""
    version = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"
    digest = xxhash.xxh3_128_hexdigest(canonical_json({"format_version": version, "content": content}))
    doc = {"magic": MANIFEST_MAGIC, "format_version": version, "digest": digest, "content": content}
    return canonical_json(doc) + b"\n", digest


def build_content(
    step: int,
    world_size: int,
    created_unix: float,
    records: list[dict[str, Any]],
    *,
    fence: int | None = None,
    attempt: str | None = None,
) -> dict[str, Any]:
    """Merge every rank's shard record (see ``saver``) into manifest content; checks agreement.

    Raises :class:`LayoutMismatch` when ranks disagree on a tensor's dtype or shape, or when the
    saved parts do not cover a tensor exactly once.
    """
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    metadata: list[Any] = []
    for rec in sorted(records, key=lambda r: r["rank"]):
        files[rec["file"]["name"]] = {k: rec["file"][k] for k in ("rank", "size", "digest")}
        metadata.append(rec["metadata"])
        for name, t in rec["tensors"].items():
            entry = tensors.setdefault(name, {"dtype": t["dtype"], "shape": t["shape"], "parts": []})
            if (entry["dtype"], entry["shape"]) != (t["dtype"], t["shape"]):
                raise LayoutMismatch(
                    f"tensor {name!r}: rank {rec['rank']} saved {t['dtype']}{t['shape']}, "
                    f"another rank {entry['dtype']}{entry['shape']}"
                )
            entry["parts"].append(
                {"rank": rec["rank"], "file": rec["file"]["name"], "region": t["region"], "chunks": t["chunks"]}
            )
    for name, entry in tensors.items():
        shape = tuple(entry["shape"])
        problem = coverage_problem(shape, [Region.from_json(shape, p["region"]) for p in entry["parts"]])
        if problem:
            raise LayoutMismatch(f"tensor {name!r}: {problem}")
    content = {
        "step": step,
        "world_size": world_size,
        "created_unix": created_unix,
        "chunk_hash": CHUNK_HASH,
        "file_hash": FILE_HASH,
        "files": files,
        "tensors": tensors,
        "metadata": metadata,
    }
    if fence is not None:
        content["fence"] = fence
    if attempt is not None:
        content["attempt"] = attempt
    return content


def parse_manifest(data: bytes) -> Manifest:
    """Parse and check a manifest file's bytes.

    Raises :class:`CheckpointCorrupt` (empty, not JSON, digest mismatch, inconsistent),
    :class:`UnsafePath` (a file name leaving the directory), :class:`UnsupportedFormat` (newer
    major version, unknown hash, codec or dtype).
    """
    if not data.strip():
        raise CheckpointCorrupt("manifest is empty", file=MANIFEST_NAME)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointCorrupt(f"manifest of {len(data)} bytes is implausibly large", file=MANIFEST_NAME)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorrupt(f"manifest is not JSON ({exc.__class__.__name__})", file=MANIFEST_NAME) from exc
    if json_depth_exceeds(doc, MAX_MANIFEST_DEPTH):
        raise CheckpointCorrupt(f"manifest is nested deeper than {MAX_MANIFEST_DEPTH} levels", file=MANIFEST_NAME)
    if not isinstance(doc, dict) or doc.get("magic") != MANIFEST_MAGIC:
        raise CheckpointCorrupt("not a stalwart manifest", file=MANIFEST_NAME)
    version = doc.get("format_version")
    match = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if not match:
        raise CheckpointCorrupt(f"bad format_version {version!r}", file=MANIFEST_NAME)
    major, minor = int(match.group(1)), int(match.group(2))
    if major > FORMAT_MAJOR:
        raise UnsupportedFormat(
            f"checkpoint format {version} is newer than this reader ({FORMAT_MAJOR}.{FORMAT_MINOR}); "
            "upgrade stalwart to read it"
        )
    content = doc.get("content")
    try:
        digest = xxhash.xxh3_128_hexdigest(canonical_json({"format_version": version, "content": content}))
    except (TypeError, ValueError) as exc:
        raise CheckpointCorrupt("manifest content cannot be canonicalized", file=MANIFEST_NAME) from exc
    if digest != doc.get("digest"):
        raise CheckpointCorrupt("manifest digest mismatch", file=MANIFEST_NAME)
    try:
        manifest = _parse_content(content, (major, minor), digest)
    except (UnsafePath, UnsupportedFormat, CheckpointCorrupt):
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, LayoutMismatch,
            RecursionError) as exc:
        raise CheckpointCorrupt(f"malformed manifest ({exc.__class__.__name__}: {exc})", file=MANIFEST_NAME) from exc
    return manifest


def _parse_content(content: Any, version: tuple[int, int], digest: str) -> Manifest:
    """Build the manifest and run every structural check that needs no tensor bytes: the same
    checks for ``load`` and ``verify``, so nothing ``verify`` would refuse is ever loaded."""
    if content["chunk_hash"] != CHUNK_HASH or content["file_hash"] != FILE_HASH:
        raise UnsupportedFormat(f"unknown hash {content['chunk_hash']!r}/{content['file_hash']!r}")
    step, world_size = _nonneg(content["step"]), _nonneg(content["world_size"])
    files: dict[str, FileRecord] = {}
    for name, f in content["files"].items():
        files[check_name(name)] = FileRecord(name, _nonneg(f["rank"]), _nonneg(f["size"]), str(f["digest"]))
        if files[name].rank >= world_size:
            raise ValueError(f"file {name} of rank {files[name].rank} in a world of {world_size}")
    ranks = sorted(f.rank for f in files.values())
    if len(ranks) != world_size or ranks != list(range(len(ranks))):
        raise ValueError(f"files {sorted(files)} are not one per rank of a world of {world_size}")
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name in files}
    tensors: dict[str, TensorRecord] = {}
    for name, t in content["tensors"].items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r} is not a non-empty string")
        if t["dtype"] not in DTYPES:
            raise UnsupportedFormat(f"tensor {name!r}: unknown dtype {t['dtype']!r}")
        shape = tuple(_nonneg(d) for d in t["shape"])
        itemsize = torch.empty((), dtype=DTYPES[t["dtype"]]).element_size()
        parts = []
        for p in t["parts"]:
            file = check_name(p["file"])
            if file not in files:
                raise ValueError(f"tensor {name!r} refers to unlisted file {file}")
            rank = _nonneg(p["rank"])
            if rank != files[file].rank:
                raise ValueError(f"tensor {name!r}: part of rank {rank} in {file} of rank {files[file].rank}")
            region = Region.from_json(shape, p["region"])
            region.validate()
            chunks = tuple(_parse_chunk(c, files[file], itemsize) for c in p["chunks"])
            if sum(c.raw for c in chunks) != region.numel * itemsize:
                raise ValueError(f"tensor {name!r}: chunks of {file} do not hold its region")
            for before, after in itertools.pairwise(chunks):
                if after.offset != before.offset + before.stored:
                    raise ValueError(f"tensor {name!r}: chunks in {file} are not consecutive")
            if chunks:
                spans[file].append((chunks[0].offset, chunks[-1].offset + chunks[-1].stored))
            parts.append(PartRecord(rank, file, region, chunks))
        problem = coverage_problem(shape, [p.region for p in parts])
        if problem:
            raise ValueError(f"tensor {name!r}: {problem}")
        tensors[name] = TensorRecord(name, t["dtype"], shape, tuple(parts))
    for name, ranges in spans.items():  # each file: header, then every chunk once, back to back
        pos = HEADER_SIZE
        for lo, hi in sorted(ranges):
            if lo != pos:
                raise ValueError(f"{name}: chunks leave a gap or overlap at byte {min(lo, pos)}")
            pos = hi
        if pos != files[name].size:
            raise ValueError(f"{name}: chunks end at {pos}, the file has {files[name].size} bytes")
    raw_meta = content["metadata"]
    if not isinstance(raw_meta, list) or len(raw_meta) != world_size or not all(isinstance(m, dict) for m in raw_meta):
        raise ValueError(f"metadata must be one object per rank of a world of {world_size}")
    metadata = [decode_metadata(m) for m in raw_meta]
    fence = content.get("fence")
    if fence is not None:
        fence = _nonneg(fence)
    attempt = content.get("attempt")
    if attempt is not None and not isinstance(attempt, str):
        raise TypeError("attempt must be a string")
    created = content["created_unix"]
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise TypeError("created_unix must be a number")
    return Manifest(
        step=step,
        world_size=world_size,
        created_unix=float(created),
        files=files,
        tensors=tensors,
        metadata=metadata,
        version=version,
        digest=digest,
        fence=fence,
        attempt=attempt,
    )


def _parse_chunk(raw: Any, file: FileRecord, itemsize: int) -> ChunkRecord:
    if not isinstance(raw, list):
        raise TypeError("a chunk must be a list")
    offset, stored, size, codec, digest = raw
    chunk = ChunkRecord(_nonneg(offset), _nonneg(stored), _nonneg(size), codec, digest)
    if codec not in CODECS:
        raise UnsupportedFormat(f"unknown codec {codec!r} in {file.name}")
    if chunk.offset < HEADER_SIZE or chunk.offset + chunk.stored > file.size:
        raise ValueError(f"chunk at {chunk.offset}+{chunk.stored} outside {file.name} of {file.size} bytes")
    if chunk.raw > MAX_CHUNK_BYTES or chunk.stored > MAX_CHUNK_BYTES or chunk.raw % itemsize:
        raise ValueError(f"chunk sizes {chunk.stored}/{chunk.raw} are not plausible")
    if codec == "raw" and chunk.stored != chunk.raw:
        raise ValueError("raw chunk with different stored and raw sizes")
    if not isinstance(digest, str):
        raise TypeError("chunk digest must be a string")
    return chunk


def _nonneg(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value
