"""Retention policy (pure) and garbage collection (locks, verified checkpoints, crashed saves)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from stalwart.ckpt import Checkpointer, RetentionPolicy, SaveConfig, collect_garbage, list_checkpoints, load, verify
from stalwart.ckpt.format import step_dir_name
from stalwart.ckpt.retention import select_removals
from stalwart.ckpt.storage import shared_lock


@pytest.mark.parametrize(
    "steps, verified, policy, removed",
    [
        ([1, 2, 3, 4, 5], None, RetentionPolicy(keep_last=2), [1, 2, 3]),
        ([1, 2, 3, 4, 5], 1, RetentionPolicy(keep_last=2), [2, 3]),
        ([10, 20, 30, 40, 50], None, RetentionPolicy(keep_last=1, keep_every=20), [10, 30]),
        ([5], None, RetentionPolicy(keep_last=1), []),
        ([], None, RetentionPolicy(keep_last=1), []),
    ],
)
def test_select_removals(steps, verified, policy, removed):
    assert select_removals(steps, verified, policy) == removed


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": -1}, {"garbage_grace_s": -1}])
def test_policy_is_validated(kwargs):
    with pytest.raises(ValueError):
        RetentionPolicy(**kwargs)


def _save_steps(root, steps):
    config = SaveConfig(chunk_bytes=4096, retention=None)
    with Checkpointer(root, config) as ckpt:
        for step in steps:
            ckpt.save(step, {"t": torch.full((100,), float(step))}).result()


def _steps(root):
    return [c.step for c in list_checkpoints(root)]


def test_newest_verified_checkpoint_is_never_removed(tmp_path):
    root = str(tmp_path)
    _save_steps(root, [1, 2, 3, 4])
    assert verify(root, 2).ok
    collect_garbage(root, RetentionPolicy(keep_last=1))
    assert _steps(root) == [2, 4]


def test_a_checkpoint_being_loaded_is_not_removed(tmp_path):
    root = str(tmp_path)
    _save_steps(root, [1, 2, 3])
    with shared_lock(os.path.join(root, step_dir_name(1)), create=False):  # what a loader holds
        report = collect_garbage(root, RetentionPolicy(keep_last=1))
    assert report.busy == [1] and report.removed == [2]
    assert _steps(root) == [1, 3]
    out = torch.empty(100)
    assert load(root, {"t": out}, step=1).step == 1 and out[0].item() == 1.0


def test_lock_held_by_another_process_blocks_removal(tmp_path):
    root = str(tmp_path)
    _save_steps(root, [1, 2])
    lock = os.path.join(root, step_dir_name(1), ".lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys
            fd = os.open({lock!r}, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            print("held", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert collect_garbage(root, RetentionPolicy(keep_last=1)).busy == [1]
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert collect_garbage(root, RetentionPolicy(keep_last=1)).removed == [1]


def test_unfinished_saves_are_garbage_but_never_loaded(tmp_path):
    root = str(tmp_path)
    _save_steps(root, [1, 3])
    for step in (2, 4):  # crashed saves: one older, one newer than the newest commit
        os.makedirs(os.path.join(root, step_dir_name(step)))
        with open(os.path.join(root, step_dir_name(step), "rank-00000.bin"), "wb") as f:
            f.write(b"torn")
    out = torch.empty(100)
    assert load(root, {"t": out}).step == 3
    report = collect_garbage(root, RetentionPolicy(keep_last=5))
    assert report.garbage_removed == [2]  # 4 may still be in progress elsewhere: grace period
    report = collect_garbage(root, RetentionPolicy(keep_last=5, garbage_grace_s=0))
    assert report.garbage_removed == [4]
    assert _steps(root) == [1, 3]
    assert not [n for n in os.listdir(root) if n.startswith(".trash")]


def test_a_refused_checkpoint_set_aside_frees_its_step(tmp_path):
    from stalwart.ckpt.storage import set_aside

    root = str(tmp_path)
    _save_steps(root, [1, 2])
    moved = set_aside(root, 2)  # as the trainer does after the loader skipped it
    assert moved is not None and os.path.basename(moved).startswith("corrupt-step-")
    assert _steps(root) == [1]
    _save_steps(root, [2])  # the re-run saves step 2 again
    assert _steps(root) == [1, 2] and verify(root, 2).ok
    assert set_aside(root, 9) is None
