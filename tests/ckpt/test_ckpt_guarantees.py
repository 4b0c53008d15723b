"""What no input, no neighbour and no full disk may break: each test names the failure it guards."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import xxhash
from ckpt_testlib import SPECS, check_targets, rank_state, rank_targets, run_ranks

from stalwart.ckpt import (
    CallbackCoordinator,
    CheckpointCorrupt,
    Checkpointer,
    CheckpointError,
    CheckpointExists,
    CommitFailed,
    LayoutMismatch,
    RetentionPolicy,
    SaveConfig,
    Shard,
    collect_garbage,
    list_checkpoints,
    load,
    read_manifest,
    verify,
)
from stalwart.ckpt.format import LOCK_NAME, MANIFEST_NAME, canonical_json, step_dir_name

STALWART = os.path.join(os.path.dirname(sys.executable), "stalwart")
SMALL = SaveConfig(chunk_bytes=4096, retention=None)


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, step_dir_name(step))


def _save(root: str, step: int, value: float, n: int = 1000, config: SaveConfig = SMALL) -> None:
    with Checkpointer(root, config) as ckpt:
        ckpt.save(step, {"t": torch.full((n,), value)}).result()


def _load_t(root: str, n: int = 1000, **kwargs: object) -> tuple[int, torch.Tensor]:
    out = torch.empty(n)
    return load(root, {"t": out}, **kwargs).step, out  # type: ignore[arg-type]


def _rewrite_manifest(root: str, step: int, edit) -> None:  # type: ignore[no-untyped-def]
    """Apply ``edit`` to the manifest content and recompute its digest, as a forger would."""
    path = os.path.join(_step_dir(root, step), MANIFEST_NAME)
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    edit(doc["content"])
    version = doc["format_version"]
    doc["digest"] = xxhash.xxh3_128_hexdigest(canonical_json({"format_version": version, "content": doc["content"]}))
    with open(path, "wb") as f:
        f.write(canonical_json(doc))


def _steps(root: str) -> list[int]:
    return [c.step for c in list_checkpoints(root)]


# --- 0: save() then close() at once --------------------------------------------------------------


def test_close_right_after_save_commits_the_data_it_was_given(tmp_path):
    root = str(tmp_path)
    config = SaveConfig(retention=RetentionPolicy(keep_last=1))
    _save(root, 1, 1.0, 4096, config)
    ckpt = Checkpointer(root, config)
    # gc's exclusive lock holds the persist thread before it writes anything, so close() surely
    # runs while the save is still in flight.
    os.makedirs(_step_dir(root, 2))
    fd = os.open(os.path.join(_step_dir(root, 2), LOCK_NAME), os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    state = torch.arange(4096, dtype=torch.float32)  # 16 KiB
    handle = ckpt.save(2, {"t": state})
    closer = threading.Thread(target=ckpt.close)
    closer.start()
    while not ckpt._closed:  # noqa: SLF001 - close() has begun
        time.sleep(0.001)
    time.sleep(0.05)
    os.close(fd)
    closer.join()
    info = handle.result(60)
    assert info.logical_bytes == 16384
    step, out = _load_t(root, 4096)
    assert step == 2 and torch.equal(out, state)


def test_a_commit_never_records_fewer_bytes_than_the_state(tmp_path, monkeypatch):
    """A writer that loses chunks (here: a chunking bug) fails its save; the good step stays."""
    import stalwart.ckpt.saver as saver

    root = str(tmp_path)
    config = SaveConfig(chunk_bytes=4096, retention=RetentionPolicy(keep_last=1))
    _save(root, 1, 1.0, 4096, config)
    real = saver.chunk_bounds
    monkeypatch.setattr(saver, "chunk_bounds", lambda *a: real(*a)[:-1])
    with Checkpointer(root, config) as ckpt, pytest.raises(CommitFailed):
        ckpt.save(2, {"t": torch.zeros(4096)}).result(60)
    monkeypatch.setattr(saver, "chunk_bounds", real)
    assert [c.step for c in list_checkpoints(root) if c.committed] == [1]
    step, out = _load_t(root, 4096)
    assert step == 1 and bool((out == 1.0).all())


# --- 1: gc counts only intact checkpoints ---------------------------------------------------------


def _damage_manifest(root: str, step: int) -> None:
    path = os.path.join(_step_dir(root, step), MANIFEST_NAME)
    with open(path, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0x10]))


def test_gc_never_removes_the_newest_loadable_checkpoint(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        _save(root, step, float(step))
    _damage_manifest(root, 3)
    report = collect_garbage(root, RetentionPolicy(keep_last=1))
    assert report.removed == [1]
    assert [s for s, _ in report.damaged] == [3]
    assert _steps(root) == [2, 3]
    step, out = _load_t(root)
    assert step == 2 and bool((out == 2.0).all())


def test_gc_cli_keeps_the_newest_loadable_checkpoint(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        _save(root, step, float(step))
    _damage_manifest(root, 3)
    done = subprocess.run([STALWART, "ckpt", "gc", root, "--keep-last", "1"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert _steps(root) == [2, 3]
    assert "damaged" in done.stdout and "3" in done.stdout


def test_retention_after_a_commit_keeps_the_good_step_when_newer_ones_are_damaged(tmp_path):
    root = str(tmp_path)
    config = SaveConfig(chunk_bytes=4096, retention=RetentionPolicy(keep_last=1))
    _save(root, 1, 1.0, config=config)
    _save(root, 2, 2.0, config=config)
    os.truncate(os.path.join(_step_dir(root, 2), "rank-00000.bin"), 100)  # step 2 lost its data
    _save(root, 3, 3.0, config=config)  # retention runs after this commit
    assert 2 in _steps(root) and 3 in _steps(root)
    _damage_manifest(root, 3)
    _save(root, 4, 4.0, config=config)
    assert _load_t(root)[0] == 4
    assert 1 not in _steps(root)


# --- 2: load runs verify's structural checks ------------------------------------------------------


def _save_two_ranks(root: str, steps=(1, 2)) -> None:  # type: ignore[no-untyped-def]
    def rank(r, coord):  # type: ignore[no-untyped-def]
        with Checkpointer(root, SMALL, coordinator=coord) as ckpt:
            for step in steps:
                ckpt.save(step, rank_state(SPECS, {}, step, 2, r)).result()

    run_ranks(2, rank)


def test_overlapping_flat_parts_with_a_gap_are_refused_by_load(tmp_path):
    root = str(tmp_path)
    _save_two_ranks(root)

    def overlap(content):  # type: ignore[no-untyped-def]
        part = content["tensors"]["bf"]["parts"][1]  # rank 1 holds [501, 1001) of 1001
        start, stop = part["region"]["flat"]
        part["region"]["flat"] = [start - 10, stop - 10]  # overlaps rank 0, leaves the last 10 out

    _rewrite_manifest(root, 2, overlap)
    assert not verify(root, 2, mark=False).ok
    with pytest.raises(CheckpointCorrupt, match="overlap"):
        read_manifest(root, 2)
    targets = rank_targets(SPECS, {}, 1, 0)
    result = load(root, targets)
    assert result.step == 1 and [s for s, _ in result.skipped] == [2]
    assert check_targets(SPECS, targets, 1) == []
    with pytest.raises(CheckpointCorrupt):
        load(root, rank_targets(SPECS, {}, 1, 0), step=2)


def test_a_flat_part_overlapping_a_box_part_is_refused(tmp_path):
    """A tensor of 10 x 10: rank 0 saved rows 0-4 as a flat range, rank 1 rows 5-9 as a box; the
    forged box of rows 4-8 overlaps row 4 and leaves row 9 out."""
    root = str(tmp_path)
    full = torch.arange(100, dtype=torch.float32).view(10, 10)

    def rank(r, coord):  # type: ignore[no-untyped-def]
        shard = Shard.flat(full[:5].reshape(-1).clone(), (10, 10), 0) if r == 0 else \
            Shard.box(full[5:].clone(), (10, 10), (5, 0))
        with Checkpointer(root, SMALL, coordinator=coord) as ckpt:
            for step in (1, 2):
                ckpt.save(step, {"t": shard}).result()

    run_ranks(2, rank)

    def shift(content):  # type: ignore[no-untyped-def]
        content["tensors"]["t"]["parts"][1]["region"]["offsets"] = [4, 0]

    _rewrite_manifest(root, 2, shift)
    out = torch.empty(10, 10)
    assert load(root, {"t": out}).step == 1 and torch.equal(out, full)
    assert not verify(root, 2, mark=False).ok


# --- 3: a failed save cleans up -------------------------------------------------------------------


def _rank_files(root: str, step: int) -> list[str]:
    try:
        return sorted(n for n in os.listdir(_step_dir(root, step)) if n.endswith(".bin"))
    except FileNotFoundError:
        return []


def test_a_failed_write_removes_its_partial_file(tmp_path, monkeypatch):
    from stalwart.ckpt import writer

    root = str(tmp_path)
    _save(root, 1, 1.0)
    real = writer.ShardWriter.write

    def write(self, data):  # type: ignore[no-untyped-def]
        if self.size > 8192:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(writer.ShardWriter, "write", write)
    with Checkpointer(root, SMALL) as ckpt, pytest.raises(CommitFailed, match="No space"):
        ckpt.save(2, {"t": torch.randn(100_000)}).result(60)
    assert _rank_files(root, 2) == []
    assert not os.path.exists(_step_dir(root, 2))


@pytest.fixture
def small_disk(tmp_path):  # type: ignore[no-untyped-def]
    """A 2 MiB tmpfs (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_after_a_full_disk_the_next_small_save_succeeds(small_disk):
    root = str(small_disk / "ckpt")
    _save(root, 1, 1.0)
    with Checkpointer(root, SMALL) as ckpt, pytest.raises(CommitFailed):
        ckpt.save(2, {"t": torch.randn(1 << 20)}).result(60)  # 4 MiB on a 2 MiB disk
    assert _rank_files(root, 2) == []
    _save(root, 3, 3.0)
    assert _load_t(root)[0] == 3


# --- 4: never write through a link ----------------------------------------------------------------


def test_save_does_not_write_through_a_link_at_a_rank_file(tmp_path):
    root = str(tmp_path / "ckpt")
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"precious")
    _save(root, 1, 1.0)
    os.makedirs(_step_dir(root, 2))
    os.symlink(outside, os.path.join(_step_dir(root, 2), "rank-00000.bin"))
    _save(root, 2, 2.0)  # written to a file of its own instead
    assert outside.read_bytes() == b"precious"
    step, out = _load_t(root)
    assert step == 2 and bool((out == 2.0).all())


def test_save_does_not_create_files_through_a_link_at_the_lock(tmp_path):
    root = str(tmp_path / "ckpt")
    target = tmp_path / "created-outside"
    _save(root, 1, 1.0)
    os.makedirs(_step_dir(root, 2))
    os.symlink(target, os.path.join(_step_dir(root, 2), LOCK_NAME))
    with pytest.raises(CommitFailed):
        _save(root, 2, 2.0)
    assert not target.exists()
    assert _load_t(root)[0] == 1


def test_save_refuses_a_step_directory_that_is_a_link(tmp_path):
    root = str(tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _save(root, 1, 1.0)
    os.symlink(elsewhere, _step_dir(root, 2))
    with pytest.raises(CommitFailed, match="not a directory"):
        _save(root, 2, 2.0)
    assert list(elsewhere.iterdir()) == []


def test_links_and_fifos_in_a_checkpoint_are_refused_when_reading(tmp_path):
    root = str(tmp_path)
    _save(root, 1, 1.0)
    _save(root, 2, 2.0)
    path = os.path.join(_step_dir(root, 2), "rank-00000.bin")
    os.unlink(path)
    os.mkfifo(path)  # a reader that opened it would wait forever
    step, _ = _load_t(root)
    assert step == 1
    assert not verify(root, 2, mark=False).ok


# --- 5: two writers of one step -------------------------------------------------------------------


def test_two_writers_of_one_step_never_mix(tmp_path):
    """A requeued job and its stale predecessor save step 5 at the same time: both shard files are
    durable before either commits. Exactly one commits; the step loads its values bitwise."""
    root = str(tmp_path)
    both_written = threading.Barrier(2)

    def writer(value: float) -> BaseException | int:
        def gather(rank, payload, timeout_s):  # type: ignore[no-untyped-def]
            both_written.wait(timeout_s)
            return [payload]

        coord = CallbackCoordinator(0, 1, gather, lambda rank, payload, timeout_s: payload)
        with Checkpointer(root, SMALL, coordinator=coord) as ckpt:
            try:
                ckpt.save(5, {"t": torch.full((50_000,), value)}).result(60)
            except CheckpointError as exc:
                return exc
        return int(value)

    results: dict[float, BaseException | int] = {}
    threads = [threading.Thread(target=lambda v=v: results.__setitem__(v, writer(v))) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [v for v, r in results.items() if not isinstance(r, BaseException)]
    losers = [r for r in results.values() if isinstance(r, BaseException)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], CheckpointExists)
    assert verify(root, 5).ok
    step, out = _load_t(root, 50_000)
    assert step == 5 and bool((out == winners[0]).all())
    assert len(_rank_files(root, 5)) == 1  # the loser removed its file


def test_a_stale_fence_cannot_commit(tmp_path):
    from stalwart.ckpt import CommitFenced

    root = str(tmp_path)
    _save(root, 5, 5.0, config=SaveConfig(chunk_bytes=4096, retention=None, fence=2))
    assert read_manifest(root, 5).fence == 2
    with pytest.raises(CommitFenced):
        _save(root, 6, 6.0, config=SaveConfig(chunk_bytes=4096, retention=None, fence=1))
    assert [c.step for c in list_checkpoints(root) if c.committed] == [5]
    assert _rank_files(root, 6) == []
    _save(root, 7, 7.0, config=SaveConfig(chunk_bytes=4096, retention=None, fence=3))
    assert read_manifest(root, 7).fence == 3


def test_a_newer_writer_that_claims_the_fence_stops_an_older_one_before_either_committed(tmp_path):
    from stalwart.ckpt import CommitFenced

    root = str(tmp_path)
    stale = Checkpointer(root, SaveConfig(chunk_bytes=4096, retention=None, fence=4))
    stale.claim_fence()  # the old world formed first
    with Checkpointer(root, SaveConfig(chunk_bytes=4096, retention=None, fence=5)) as newer:
        newer.claim_fence()  # the world that replaced it forms: nothing committed yet
        with pytest.raises(CommitFenced):
            stale.save(1, {"t": torch.full((1000,), 1.0)}).result()
        with pytest.raises(CommitFenced, match="fence 5"):
            stale.claim_fence()
        newer.save(2, {"t": torch.full((1000,), 2.0)}).result()
    stale.close()
    assert [c.step for c in list_checkpoints(root) if c.committed] == [2]
    Checkpointer(root, SaveConfig(chunk_bytes=4096, retention=None)).claim_fence()  # no token: no claim


def test_a_full_disk_does_not_stop_a_world_from_claiming_its_fence_and_the_first_commit_records_it(small_disk):
    from stalwart.ckpt import CommitFenced

    root = str(small_disk / "ckpt")
    _save(root, 1, 1.0, config=SaveConfig(chunk_bytes=4096, retention=None, fence=1))
    filler = small_disk / "filler"
    with open(filler, "wb") as f:  # the disk is full now
        with pytest.raises(OSError):
            while True:
                f.write(b"x" * 65536)
                f.flush()
    newer = Checkpointer(root, SaveConfig(chunk_bytes=4096, retention=None, fence=2))
    newer.claim_fence()  # logged, not raised: the world forms
    filler.unlink()
    newer.save(2, {"t": torch.full((1000,), 2.0)}).result(60)
    newer.close()
    assert read_manifest(root, 2).fence == 2
    with pytest.raises(CommitFenced):  # and the older writer is fenced from then on
        _save(root, 3, 3.0, config=SaveConfig(chunk_bytes=4096, retention=None, fence=1))


# --- 6: deeply nested JSON ------------------------------------------------------------------------


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_metadata_nested_too_deep_is_refused_at_save(tmp_path):
    root = str(tmp_path)
    _save(root, 1, 1.0)
    with Checkpointer(root, SMALL) as ckpt, pytest.raises(LayoutMismatch, match="nested deeper"):
        ckpt.save(2, {"t": torch.zeros(10)}, {"deep": _nested(600)})
    assert _steps(root) == [1]
    with Checkpointer(root, SMALL) as ckpt:  # deep but within the bound: saved and loaded back
        ckpt.save(3, {"t": torch.zeros(1000)}, {"deep": _nested(50)}).result()
    out = torch.empty(1000)
    assert load(root, {"t": out}).metadata[0]["deep"] == _nested(50)


@pytest.mark.parametrize("depth", [300, 1000, 100_000])
def test_a_deeply_nested_manifest_is_corrupt_not_a_crash(tmp_path, depth):
    root = str(tmp_path)
    _save(root, 1, 1.0)
    _save(root, 2, 2.0)
    path = os.path.join(_step_dir(root, 2), MANIFEST_NAME)
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    doc["content"]["metadata"] = [{"x": "@@DEEP@@"}]
    deep = "[" * depth + "]" * depth
    content = canonical_json(doc["content"]).decode().replace('"@@DEEP@@"', deep)
    version = doc["format_version"]
    digest = xxhash.xxh3_128_hexdigest(f'{{"content":{content},"format_version":"{version}"}}'.encode())
    with open(path, "w") as f:
        f.write(f'{{"content":{content},"digest":"{digest}","format_version":"{version}",'
                f'"magic":"stalwart-checkpoint"}}')
    with pytest.raises(CheckpointCorrupt):
        read_manifest(root, 2)
    assert _load_t(root)[0] == 1
    assert not verify(root, 2, mark=False).ok


# --- 7: gc on a read-only root --------------------------------------------------------------------


@contextlib.contextmanager
def _read_only(path):  # type: ignore[no-untyped-def]
    if os.geteuid() == 0:  # root ignores permissions: make the whole file system read-only
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        try:
            yield
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(path)], check=True)
    else:
        dirs = [str(path)] + [os.path.join(str(path), n) for n in os.listdir(path)]
        for d in dirs:
            os.chmod(d, 0o555)
        try:
            yield
        finally:
            for d in dirs:
                os.chmod(d, 0o755)


def test_gc_on_a_read_only_root_fails_cleanly(tmp_path):
    if os.geteuid() == 0:
        disk = tmp_path / "disk"
        disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True)
    else:
        disk = tmp_path
    try:
        root = str(disk)
        for step in (1, 2, 3):
            _save(root, step, float(step))
        with _read_only(disk):
            report = collect_garbage(root, RetentionPolicy(keep_last=1))
            assert [s for s, _ in report.errors] == [1, 2] and report.removed == []
            done = subprocess.run([STALWART, "ckpt", "gc", root, "--keep-last", "1"], capture_output=True,
                                  text=True, timeout=120)
        assert done.returncode == 1
        assert "Traceback" not in done.stderr
        assert done.stderr.strip().count("\n") == 0 and "cannot remove" in done.stderr
        assert _steps(root) == [1, 2, 3]
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("world_size", [2**40, 2**63, 2**70])
def test_an_implausible_world_size_is_corrupt_not_a_crash(tmp_path, world_size):
    """Found by the property test: a forged world size made the parser build a list of that size."""
    root = str(tmp_path)
    _save(root, 1, 1.0)
    _save(root, 2, 2.0)
    _rewrite_manifest(root, 2, lambda content: content.update(world_size=world_size))
    with pytest.raises(CheckpointCorrupt):
        read_manifest(root, 2)
    assert _load_t(root)[0] == 1


def test_a_link_at_a_committed_steps_lock_makes_it_corrupt_for_readers(tmp_path):
    root = str(tmp_path)
    _save(root, 1, 1.0)
    _save(root, 2, 2.0)
    lock = os.path.join(_step_dir(root, 2), LOCK_NAME)
    os.unlink(lock)
    os.symlink(tmp_path / "elsewhere", lock)
    step, out = _load_t(root)
    assert step == 1 and bool((out == 1.0).all())
    report = verify(root, 2)
    assert [p.file for p in report.problems] == [LOCK_NAME]
    assert not (tmp_path / "elsewhere").exists()


def test_a_file_system_without_o_direct_gets_one_buffered_file(tmp_path, monkeypatch):
    """The shard file is created exclusively first and O_DIRECT switched on afterwards: a file
    system that refuses O_DIRECT (an older tmpfs creates the file, then fails the open) must not
    make the exclusive create fail."""
    import fcntl as real_fcntl

    from stalwart.ckpt import writer

    original = real_fcntl.fcntl

    def refusing(fd, cmd, arg=0):  # type: ignore[no-untyped-def]
        if cmd == real_fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return original(fd, cmd, arg)

    monkeypatch.setattr(writer.fcntl, "fcntl", refusing)
    root = str(tmp_path)
    _save(root, 1, 1.0, 100_000)
    assert _rank_files(root, 1) == ["rank-00000.bin"]
    step, out = _load_t(root, 100_000)
    assert step == 1 and bool((out == 1.0).all())
