"""Saver behaviour: failures of one rank, timeouts, busy saves, input checks, package hygiene."""

from __future__ import annotations

import ast
import os
import pathlib
import threading

import pytest
import torch
from ckpt_testlib import SPECS, check_targets, rank_state, rank_targets, run_ranks

from stalwart.ckpt import (
    CallbackCoordinator,
    Checkpointer,
    CheckpointExists,
    CodecPolicy,
    CommitFailed,
    CommitTimeout,
    LayoutMismatch,
    RetentionPolicy,
    SaveConfig,
    SaveInProgress,
    Shard,
    list_checkpoints,
    load,
)

CKPT_DIR = pathlib.Path(__file__).resolve().parents[2] / "ckpt"
SMALL = SaveConfig(chunk_bytes=4096)


def _save(root, world, step, config=SMALL):
    def rank(r, coord):
        with Checkpointer(root, config, coordinator=coord) as ckpt:
            return ckpt.save(step, rank_state(SPECS, {}, step, world, r)).result()

    return run_ranks(world, rank)


def test_a_rank_that_cannot_write_fails_the_commit_on_every_rank(tmp_path, monkeypatch):
    import stalwart.ckpt.saver as saver

    root = str(tmp_path)
    _save(root, 2, 1)

    class Failing(saver.ShardWriter):  # rank 1 cannot write its file
        def __init__(self, path, *args):
            if "rank-00001" in os.path.basename(path):
                raise OSError(5, "Input/output error", path)
            super().__init__(path, *args)

    monkeypatch.setattr(saver, "ShardWriter", Failing)
    outcomes = []

    def rank(r, coord):
        with Checkpointer(root, SMALL, coordinator=coord) as ckpt:
            handle = ckpt.save(2, rank_state(SPECS, {}, 2, 2, r))
            outcomes.append(type(handle.exception(60)))

    run_ranks(2, rank)
    assert outcomes == [CommitFailed, CommitFailed]
    assert [c.step for c in list_checkpoints(root) if c.committed] == [1]
    targets = rank_targets(SPECS, {}, 1, 0)
    assert load(root, targets).step == 1
    assert check_targets(SPECS, targets, 1) == []


def test_parts_that_do_not_cover_a_tensor_are_not_committed(tmp_path):
    def rank(r, coord):
        with Checkpointer(str(tmp_path), SMALL, coordinator=coord) as ckpt:
            part = Shard.flat(torch.ones(5), (20,), 5 * r)  # two ranks hold 10 of 20 elements
            return ckpt.save(1, {"t": part}).exception(60)

    assert all(isinstance(e, CommitFailed) for e in run_ranks(2, rank))
    assert not any(c.committed for c in list_checkpoints(str(tmp_path)))


def test_a_missing_rank_gives_commit_timeout(tmp_path):
    import ckpt_testlib

    group = ckpt_testlib.ThreadGroup(2)
    config = SaveConfig(chunk_bytes=4096, commit_timeout_s=0.5)
    with Checkpointer(str(tmp_path), config, coordinator=group.coordinator(0)) as ckpt:
        exc = ckpt.save(1, {"t": torch.ones(3)}).exception(30)
    assert isinstance(exc, CommitTimeout) and isinstance(exc, TimeoutError)


def _gated_coordinator(gate: threading.Event) -> CallbackCoordinator:
    def gather(rank, payload, timeout_s):
        if not gate.wait(timeout_s):
            raise TimeoutError("gate closed")
        return [payload]

    return CallbackCoordinator(0, 1, gather, lambda rank, payload, timeout_s: payload)


def test_busy_save_raises_or_waits(tmp_path):
    gate = threading.Event()
    config = SaveConfig(chunk_bytes=4096, if_busy="raise")
    with Checkpointer(str(tmp_path), config, coordinator=_gated_coordinator(gate)) as ckpt:
        first = ckpt.save(1, {"t": torch.ones(3)})
        with pytest.raises(SaveInProgress):
            ckpt.save(2, {"t": torch.ones(3)})
        gate.set()
        assert first.result(30).step == 1
    gate.clear()
    waiting = SaveConfig(chunk_bytes=4096, if_busy="wait")
    with Checkpointer(str(tmp_path / "w"), waiting, coordinator=_gated_coordinator(gate)) as ckpt:
        first = ckpt.save(1, {"t": torch.ones(3)})
        threading.Timer(0.2, gate.set).start()
        second = ckpt.save(2, {"t": torch.ones(3)})  # waits for the first
        assert first.done()
        assert second.result(30).step == 2


def test_callback_timeout_becomes_commit_timeout(tmp_path):
    gate = threading.Event()
    config = SaveConfig(chunk_bytes=4096, commit_timeout_s=0.2)
    with Checkpointer(str(tmp_path), config, coordinator=_gated_coordinator(gate)) as ckpt:
        assert isinstance(ckpt.save(1, {"t": torch.ones(3)}).exception(30), CommitTimeout)


def test_committed_step_is_never_overwritten(tmp_path):
    with Checkpointer(str(tmp_path), SMALL) as ckpt:
        ckpt.save(1, {"t": torch.ones(3)}).result()
        with pytest.raises(CheckpointExists):
            ckpt.save(1, {"t": torch.zeros(3)})


@pytest.mark.parametrize(
    "metadata",
    [{"x": float("nan")}, {"x": {1, 2}}, {1: "int key"}, {"t": torch.ones(1)}, {"$bytes": "reserved"},
     {"b": b"x" * 5000}],
)
def test_metadata_that_json_cannot_hold_is_refused(tmp_path, metadata):
    config = SaveConfig(chunk_bytes=4096, max_metadata_bytes=4096)
    with Checkpointer(str(tmp_path), config) as ckpt, pytest.raises(LayoutMismatch):
        ckpt.save(1, {"t": torch.ones(3)}, metadata)


@pytest.mark.parametrize(
    "state",
    [
        {"t": Shard.flat(torch.ones(4), (3,), 0)},
        {"t": Shard.box(torch.ones(2, 2), (3, 3), (2, 0))},
        {"t": "not a tensor"},
        {"t": torch.ones(2).to_sparse()},
    ],
)
def test_bad_state_is_refused_before_anything_is_written(tmp_path, state):
    with Checkpointer(str(tmp_path), SMALL) as ckpt, pytest.raises(LayoutMismatch):
        ckpt.save(1, state)
    assert list_checkpoints(str(tmp_path)) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_bytes": 10},
        {"encode_threads": 0},
        {"commit_timeout_s": 0},
        {"if_busy": "drop"},
        {"snapshot": "lazy"},
    ],
)
def test_config_is_validated(kwargs):
    with pytest.raises(ValueError):
        SaveConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [{"mode": "lz4"}, {"level": 99}, {"min_ratio": 0.5}])
def test_codec_policy_is_validated(kwargs):
    with pytest.raises(ValueError):
        CodecPolicy(**kwargs)


def test_retention_keeps_last_and_every_mth(tmp_path):
    config = SaveConfig(chunk_bytes=4096, retention=RetentionPolicy(keep_last=2, keep_every=3))
    with Checkpointer(str(tmp_path), config) as ckpt:
        for step in range(1, 9):
            ckpt.save(step, {"t": torch.full((4,), float(step))}).result()
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [3, 6, 7, 8]


def test_package_uses_no_pickle_and_imports_nothing_else_of_stalwart():
    for path in CKPT_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert "pickle" not in name, path
                assert not name.startswith("stalwart.") or name.startswith("stalwart.ckpt"), (path, name)
            # The checkpoint format never pickles; export's ``--to pt`` writes torch's own format on
            # request (read back with weights_only=True), its one use of torch.save/torch.load.
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch" \
                    and path.name != "export.py":
                assert node.attr not in ("load", "save"), path


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, so a test can fill it (needs root to mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    import subprocess

    root = tmp_path / "disk"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "stalwart-test", str(root)], check=True)
    yield root
    subprocess.run(["umount", "-l", str(root)], check=False)


def test_a_full_disk_fails_the_commit_with_enospc_and_the_next_save_after_freeing_commits(small_disk):
    root = str(small_disk)
    _save(root, 2, 1)
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    errors: list[BaseException | None] = []

    def rank(r, coord):
        with Checkpointer(root, SaveConfig(chunk_bytes=4096, direct_io="auto"), coordinator=coord) as ckpt:
            errors.append(ckpt.save(2, rank_state(SPECS, {}, 2, 2, r)).exception(60))

    run_ranks(2, rank)
    assert all(isinstance(e, CommitFailed) and "No space left on device" in str(e) for e in errors), errors
    assert [c.step for c in list_checkpoints(root) if c.committed] == [1]
    assert load(root, rank_targets(SPECS, {}, 1, 0)).step == 1
    filler.unlink()
    _save(root, 2, 3)
    targets = rank_targets(SPECS, {}, 3, 0)
    assert load(root, targets).step == 3
    assert check_targets(SPECS, targets, 3) == []


def test_an_abandoned_checkpointer_never_commits_its_save_in_flight(tmp_path):
    root = str(tmp_path)
    _save(root, 2, 1)
    errors: list[BaseException | None] = []

    def rank(r, coord):
        with Checkpointer(root, SMALL, coordinator=coord) as ckpt:
            if r == 0:
                ckpt.abandon()  # as a re-form does while the save of step 2 is still in flight
            errors.append(ckpt.save(2, rank_state(SPECS, {}, 2, 2, r)).exception(60))

    run_ranks(2, rank)
    assert all(isinstance(e, CommitFailed) and "abandoned" in str(e) for e in errors), errors
    assert [c.step for c in list_checkpoints(root) if c.committed] == [1]
