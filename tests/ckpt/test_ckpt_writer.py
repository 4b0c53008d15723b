"""ShardWriter: O_DIRECT through bounce buffers and buffered writes give the same file."""

from __future__ import annotations

import os
import random

import pytest
import xxhash

from stalwart.ckpt.writer import ShardWriter


def _pieces(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [64, 1, 4095, 4096, 4097, 70_000, 0, 123_457, 8 << 10, 3]
    return [rng.randbytes(n) for n in sizes]


def _dirs(tmp_path):
    dirs = [str(tmp_path)]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):  # tmpfs: O_DIRECT may be refused
        dirs.append("/dev/shm")
    return dirs


@pytest.mark.parametrize("direct", ["auto", "off"])
@pytest.mark.parametrize("buffer_bytes", [4096, 3 * 4096, 1 << 20])
def test_same_bytes_and_digest(tmp_path, direct, buffer_bytes):
    pieces = _pieces(buffer_bytes)
    expected = b"".join(pieces)
    for directory in _dirs(tmp_path):
        path = os.path.join(directory, f"ckpt-writer-test-{os.getpid()}-{direct}.bin")
        try:
            writer = ShardWriter(path, direct, buffer_bytes=buffer_bytes)
            for p in pieces:
                writer.write(memoryview(p))
            size, digest = writer.finish()
            with open(path, "rb") as f:
                assert f.read() == expected
            assert size == len(expected)
            assert digest == xxhash.xxh3_128_hexdigest(expected)
        finally:
            if os.path.exists(path):
                os.unlink(path)


def test_abort_closes_without_error(tmp_path):
    writer = ShardWriter(str(tmp_path / "x.bin"), "auto")
    writer.write(b"abc")
    writer.abort()
