"""Crash consistency: a process saving in a loop is SIGKILLed at random moments.

After every kill: the newest loadable checkpoint is bitwise what was saved at its step, it is not
older than the last commit the process saw, every committed checkpoint verifies, and every commit
the process saw is still there unless the retention policy allowed its removal. The next trial
resumes in the same directory, like a restarted job, every few trials a fresh one.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from ckpt_crash_child import CONFIG, CRASH_SPECS
from ckpt_testlib import check_targets, rank_targets

from stalwart.ckpt import CheckpointNotFound, list_checkpoints, load, verify

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_crash_child.py")
TRIALS_PER_DIR = 5


def _check(root: str, trial: int) -> int | None:
    errors = os.path.join(root, "errors.log")
    assert not os.path.exists(errors), open(errors).read()
    seen = []
    if os.path.exists(os.path.join(root, "committed.log")):
        with open(os.path.join(root, "committed.log")) as f:
            seen = [int(x) for x in f.read().split() if x.isdigit()]
    committed = [c.step for c in list_checkpoints(root) if c.committed]
    try:
        targets = rank_targets(CRASH_SPECS, {}, 1, 0)
        result = load(root, targets)
    except CheckpointNotFound:
        assert not seen and not committed, f"trial {trial}: commits {seen} on record, nothing loadable"
        return None
    assert result.skipped == [], f"trial {trial}: a committed checkpoint did not load: {result.skipped}"
    assert check_targets(CRASH_SPECS, targets, result.step) == [], f"trial {trial}: step {result.step} differs"
    assert not seen or result.step >= max(seen), f"trial {trial}: newest {result.step} older than commit {max(seen)}"
    for step in committed:
        report = verify(root, step, mark=False)
        assert report.ok, f"trial {trial}: step {step}: {report.problems}"
    policy = CONFIG.retention
    for step in seen:
        newer = [s for s in committed if s > step]
        may_go = step % policy.keep_every != 0 and len(newer) >= policy.keep_last
        assert step in committed or may_go, f"trial {trial}: committed step {step} lost ({committed})"
    return result.step


def run_trials(base: str, trials: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    server = subprocess.Popen(
        [sys.executable, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    stats = {"trials": 0, "empty": 0, "max_step": 0}
    try:
        assert server.stdout.readline().strip() == "ready"
        for trial in range(trials):
            root = os.path.join(base, f"run{trial // TRIALS_PER_DIR}")
            os.makedirs(root, exist_ok=True)
            server.stdin.write(root + "\n")
            server.stdin.flush()
            pid = int(server.stdout.readline().split()[1])
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(pid, signal.SIGKILL)
            status = server.stdout.readline().split()
            assert status[0] == "exit"
            exited = int(status[1])
            assert os.WIFSIGNALED(exited), f"trial {trial}: the saver ended on its own ({exited}); see errors.log"
            step = _check(root, trial)
            stats["trials"] += 1
            stats["empty"] += step is None
            stats["max_step"] = max(stats["max_step"], step or 0)
    finally:
        server.stdin.close()
        server.wait(30)
    return stats


def test_sigkill_during_saves(tmp_path):
    stats = run_trials(str(tmp_path), 50, seed=20240611)
    print(stats)
    assert stats["trials"] == 50
    assert stats["max_step"] > 5  # the kills did land among many saves, not all before the first


@pytest.mark.slow
def test_sigkill_during_saves_soak(tmp_path):
    stats = run_trials(str(tmp_path), 1000, seed=7)
    print(stats)
    assert stats["trials"] == 1000
