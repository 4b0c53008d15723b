"""User state and an lr_scheduler instance through a checkpoint: saved at world 1, restored at
world 2 (the state registered after the restore), training on from where they were."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from state_child import GAMMA, LR
from trainer_testlib import Torchrun, tail

CHILD = str(Path(__file__).with_name("state_child.py"))
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def runs(torchrun_jobs: Torchrun, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("state")
    for mode, world in (("save", 1), ("restore", 2)):
        log = out / f"{mode}.log"
        assert torchrun_jobs.run(world, CHILD, mode, str(out), log=log) == 0, tail(log)
    return {m: json.loads((out / f"{m}.json").read_text()) for m in ("save", "restore")}


def _lr(steps_done: int) -> float:
    """StepLR(step_size=2): the learning rate after ``steps_done`` steps (DeepSpeed steps the
    scheduler with the optimizer; the children read it after each step)."""
    return LR * GAMMA ** (steps_done // 2)


def test_the_scheduler_instance_drives_the_engine_and_allows_reform(runs: dict[str, Any]) -> None:
    saved = runs["save"]
    assert saved["lrs"] == pytest.approx([_lr(k) for k in range(1, 5)], rel=1e-12)
    assert saved["cannot_reform"] is None


def test_the_scheduler_resumes_its_schedule_after_the_restore(runs: dict[str, Any]) -> None:
    restored = runs["restore"]
    assert restored["step"] == 4 and restored["last_epoch"] == 4
    assert restored["lr"] == pytest.approx(_lr(4), rel=1e-12)
    assert restored["lrs"] == pytest.approx([_lr(5), _lr(6)], rel=1e-12)


def test_user_state_registered_after_the_restore_is_the_saved_one(runs: dict[str, Any]) -> None:
    saved, restored = runs["save"], runs["restore"]
    assert restored["updates"] == saved["updates"] == 4
    assert restored["ema"] == saved["ema"]  # every float exactly (tensors are stored raw)
    assert restored["mixer"] == saved["mixer"] == {"weights": [4.0, 0.0], "seen": [1, 2, 3, 4]}
