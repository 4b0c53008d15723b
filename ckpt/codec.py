"""Chunk encoding: checksum the raw bytes, then store them raw or zstd-compressed.

Why not always compress (measured on a 2-core VM, see FORMAT.md): zstd level 1 runs at about
0.9 GB/s per core and shrinks random fp32 by 8 % and bf16 by 29 %, while the disk takes
0.4-1.8 GB/s with fsync. Compressing such data makes persist slower, not faster, and takes cores
from training. So ``auto`` compresses a 64 KiB sample first and compresses the chunk only when the
sample shrinks by at least ``min_ratio`` (zeros, masks, integer ids, optimizer step counters);
otherwise the chunk is stored raw and costs one xxh3 pass (> 15 GB/s).

Functions here are thread-safe: each thread keeps its own zstd contexts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import zstandard

from stalwart.ckpt.errors import CheckpointCorrupt
from stalwart.ckpt.format import chunk_digest

Buffer = bytes | bytearray | memoryview
_local = threading.local()


@dataclass(frozen=True)
class CodecPolicy:
    """How chunks are stored. ``mode``: ``auto`` (compress what shrinks well), ``zstd`` (compress
    every chunk, but keep it raw if it does not shrink at all), ``none`` (never compress)."""

    mode: Literal["auto", "zstd", "none"] = "auto"
    level: int = 1
    min_ratio: float = 1.5
    sample_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "zstd", "none"):
            raise ValueError(f"compression mode must be auto, zstd or none, got {self.mode!r}")
        if not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {self.level}")
        if self.min_ratio < 1.0:
            raise ValueError(f"min_ratio must be >= 1.0, got {self.min_ratio}")
        if self.sample_bytes < 1024:
            raise ValueError(f"sample_bytes must be >= 1024, got {self.sample_bytes}")


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def encode(raw: memoryview, policy: CodecPolicy) -> tuple[str, Buffer, str]:
    """``(codec, stored_bytes, digest_of_raw)`` for one chunk. ``stored_bytes`` may be ``raw``
    itself, so the caller must keep ``raw`` unchanged until the bytes are written."""
    digest = chunk_digest(raw)
    if policy.mode == "none" or len(raw) == 0:
        return "raw", raw, digest
    compressor = _compressor(policy.level)
    if policy.mode == "auto" and len(raw) > policy.sample_bytes:
        sample = raw[: policy.sample_bytes]
        if len(sample) < policy.min_ratio * len(compressor.compress(sample)):
            return "raw", raw, digest
    packed = compressor.compress(raw)
    needed = policy.min_ratio if policy.mode == "auto" else 1.0
    if len(raw) < needed * len(packed) or len(packed) >= len(raw):
        return "raw", raw, digest
    return "zstd", packed, digest


def decode(stored: Buffer, codec: str, raw_size: int, digest: str, *, file: str, chunk: int) -> Buffer:
    """The raw bytes of a chunk, verified against ``digest``. Raises :class:`CheckpointCorrupt`."""
    if codec == "raw":
        data: Buffer = stored
    elif codec == "zstd":
        try:
            declared = zstandard.frame_content_size(stored)
            if declared != raw_size:
                raise CheckpointCorrupt(
                    f"zstd frame declares {declared} bytes, manifest {raw_size}", file=file, chunk=chunk
                )
            data = _decompressor().decompress(stored, max_output_size=raw_size)
        except zstandard.ZstdError as exc:
            raise CheckpointCorrupt(f"zstd cannot decode the chunk ({exc})", file=file, chunk=chunk) from exc
    else:
        raise CheckpointCorrupt(f"unknown codec {codec!r}", file=file, chunk=chunk)
    if len(data) != raw_size:
        raise CheckpointCorrupt(f"chunk holds {len(data)} bytes, manifest says {raw_size}", file=file, chunk=chunk)
    if chunk_digest(data) != digest:
        raise CheckpointCorrupt("checksum mismatch", file=file, chunk=chunk)
    return data
