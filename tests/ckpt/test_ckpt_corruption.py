"""Damaged checkpoints: each defect gives its error, the loader falls back, verify reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import xxhash
from ckpt_testlib import SPECS, check_targets, rank_state, rank_targets, run_ranks

from stalwart.ckpt import (
    CheckpointCorrupt,
    Checkpointer,
    CheckpointError,
    CheckpointNotFound,
    CodecPolicy,
    RetentionPolicy,
    SaveConfig,
    UnsafePath,
    UnsupportedFormat,
    load,
    read_manifest,
    verify,
)
from stalwart.ckpt.format import HEADER_SIZE, MANIFEST_NAME, canonical_json, step_dir_name

STALWART = os.path.join(os.path.dirname(sys.executable), "stalwart")


def _make(root, mode="zstd", world=2):
    config = SaveConfig(chunk_bytes=4096, compression=CodecPolicy(mode=mode), retention=RetentionPolicy(keep_last=9))

    def rank(r, coord):
        with Checkpointer(root, config, coordinator=coord) as ckpt:
            for step in (1, 2):
                ckpt.save(step, rank_state(SPECS, {}, step, world, r), {"rank": r}).result()

    run_ranks(world, rank)


def _path(root, step, name):
    return os.path.join(root, step_dir_name(step), name)


def _flip(path, offset, bit=0):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _rewrite_manifest(root, step, edit, version="1.0"):
    path = _path(root, step, MANIFEST_NAME)
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    edit(doc["content"])
    doc["format_version"] = version
    doc["digest"] = xxhash.xxh3_128_hexdigest(canonical_json({"format_version": version, "content": doc["content"]}))
    with open(path, "wb") as f:
        f.write(canonical_json(doc))


def _assert_falls_back(root, error_type):
    """Loading picks step 1, bitwise, and names step 2 as skipped; asking for step 2 raises."""
    targets = rank_targets(SPECS, {}, 1, 0)
    result = load(root, targets)
    assert result.step == 1
    assert [s for s, _ in result.skipped] == [2]
    assert check_targets(SPECS, targets, 1) == []
    with pytest.raises(error_type):
        load(root, rank_targets(SPECS, {}, 1, 0), step=2)


def _verify_cli(root, step):
    return subprocess.run([STALWART, "ckpt", "verify", root, str(step)], capture_output=True, text=True, timeout=120)


def _first_chunk(root, codec):
    manifest = read_manifest(root, 2)
    for t in manifest.tensors.values():
        for p in t.parts:
            for c in p.chunks:
                if c.codec == codec and p.file == "rank-00000.bin":
                    return c
    raise AssertionError(f"no {codec} chunk")


@pytest.mark.parametrize("mode, codec", [("none", "raw"), ("zstd", "zstd")])
def test_flipped_bit_in_a_chunk(tmp_path, mode, codec):
    root = str(tmp_path)
    _make(root, mode)
    chunk = _first_chunk(root, codec)
    _flip(_path(root, 2, "rank-00000.bin"), chunk.offset + chunk.stored // 2, bit=3)
    report = verify(root, 2)
    assert not report.ok
    assert any(isinstance(p, CheckpointCorrupt) and p.file == "rank-00000.bin" and p.chunk is not None
               for p in report.problems)
    _assert_falls_back(root, CheckpointCorrupt)
    assert verify(root, 1).ok
    cli = _verify_cli(root, 2)
    assert cli.returncode == 1
    assert "rank-00000.bin" in cli.stdout


def test_flipped_bit_in_a_file_header(tmp_path):
    root = str(tmp_path)
    _make(root)
    _flip(_path(root, 2, "rank-00001.bin"), 20)
    report = verify(root, 2)
    assert any(isinstance(p, CheckpointCorrupt) and p.file == "rank-00001.bin" and p.chunk is None
               for p in report.problems)
    _assert_falls_back(root, CheckpointCorrupt)
    assert _verify_cli(root, 2).returncode == 1


def test_flipped_bits_anywhere_in_the_manifest(tmp_path):
    root = str(tmp_path)
    _make(root)
    path = _path(root, 2, MANIFEST_NAME)
    with open(path, "rb") as f:
        original = f.read()
    for n, offset in enumerate(range(0, len(original), max(1, len(original) // 25))):
        _flip(path, offset, bit=offset % 7)
        with pytest.raises((CheckpointCorrupt, UnsupportedFormat)):
            read_manifest(root, 2)
        _assert_falls_back(root, (CheckpointCorrupt, UnsupportedFormat))
        if n == 10:
            assert _verify_cli(root, 2).returncode == 1
        with open(path, "wb") as f:
            f.write(original)
    assert verify(root, 2).ok


def test_truncated_file(tmp_path):
    root = str(tmp_path)
    _make(root)
    path = _path(root, 2, "rank-00000.bin")
    os.truncate(path, os.path.getsize(path) - 100)
    assert not verify(root, 2).ok
    _assert_falls_back(root, CheckpointCorrupt)
    assert _verify_cli(root, 2).returncode == 1


def test_missing_file(tmp_path):
    root = str(tmp_path)
    _make(root)
    os.unlink(_path(root, 2, "rank-00001.bin"))
    report = verify(root, 2)
    assert [p.file for p in report.problems] == ["rank-00001.bin"]
    _assert_falls_back(root, CheckpointCorrupt)
    assert _verify_cli(root, 2).returncode == 1


@pytest.mark.parametrize("content", [b"", b"   \n", b"\x00\xff garbage {", b"[1, 2, 3]", b'{"magic": "other"}'])
def test_empty_or_garbage_manifest(tmp_path, content):
    root = str(tmp_path)
    _make(root, world=1)
    with open(_path(root, 2, MANIFEST_NAME), "wb") as f:
        f.write(content)
    report = verify(root, 2)
    assert [type(p) for p in report.problems] == [CheckpointCorrupt]
    _assert_falls_back(root, CheckpointCorrupt)
    assert _verify_cli(root, 2).returncode == 1


def test_unknown_format_version(tmp_path):
    root = str(tmp_path)
    _make(root, world=1)
    _rewrite_manifest(root, 2, lambda c: None, version="2.0")
    with pytest.raises(UnsupportedFormat):
        read_manifest(root, 2)
    _assert_falls_back(root, UnsupportedFormat)
    assert _verify_cli(root, 2).returncode == 1


def test_newer_minor_version_is_read(tmp_path):
    root = str(tmp_path)
    _make(root, world=1)
    _rewrite_manifest(root, 2, lambda c: None, version="1.7")
    targets = rank_targets(SPECS, {}, 1, 0)
    assert load(root, targets).step == 2


def test_newer_shard_header_version(tmp_path):
    root = str(tmp_path)
    _make(root, world=1)
    path = _path(root, 2, "rank-00000.bin")
    with open(path, "r+b") as f:
        header = bytearray(f.read(HEADER_SIZE))
        header[8:10] = (2).to_bytes(2, "little")
        header[-8:] = xxhash.xxh3_64_intdigest(bytes(header[:-8])).to_bytes(8, "little")
        f.seek(0)
        f.write(header)
    _assert_falls_back(root, UnsupportedFormat)


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/passwd", "sub/dir.bin", "..", "a\\b.bin", "x\x00.bin"])
def test_file_names_that_leave_the_directory_are_refused(tmp_path, name):
    root = str(tmp_path)
    _make(root, world=1)

    def edit(content):
        content["files"][name] = content["files"].pop("rank-00000.bin")
        for t in content["tensors"].values():
            for p in t["parts"]:
                p["file"] = name

    _rewrite_manifest(root, 2, edit)
    with pytest.raises(UnsafePath):
        read_manifest(root, 2)
    _assert_falls_back(root, UnsafePath)
    cli = _verify_cli(root, 2)
    assert cli.returncode == 1


def test_chunk_outside_its_file_is_refused(tmp_path):
    root = str(tmp_path)
    _make(root, world=1)

    def edit(content):
        t = next(iter(content["tensors"].values()))
        t["parts"][0]["chunks"][0][0] = 10**12

    _rewrite_manifest(root, 2, edit)
    _assert_falls_back(root, CheckpointCorrupt)


def test_all_ranks_of_a_world_fall_back_together(tmp_path):
    """Only rank 1's data is damaged; both ranks of the loading world end on step 1."""
    root = str(tmp_path)
    _make(root, mode="none")
    manifest = read_manifest(root, 2)
    part = manifest.tensors["w32"].parts[1]  # saved by rank 1: the second half of w32
    _flip(_path(root, 2, part.file), part.chunks[-1].offset + 1)

    def rank(r, coord):
        targets = rank_targets(SPECS, {}, 2, r)
        result = load(root, targets, coordinator=coord)
        return result.step, check_targets(SPECS, targets, result.step)

    assert run_ranks(2, rank) == [(1, []), (1, [])]


def test_nothing_loadable(tmp_path):
    root = str(tmp_path)
    with pytest.raises(CheckpointNotFound):
        load(root, {})
    _make(root, world=1)
    for step in (1, 2):
        os.unlink(_path(root, step, "rank-00000.bin"))
    with pytest.raises(CheckpointNotFound) as info:
        load(root, rank_targets(SPECS, {}, 1, 0))
    assert isinstance(info.value, CheckpointError)
