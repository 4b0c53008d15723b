"""The collective timer: unit checks, and that it sees a real DeepSpeed ZeRO engine's collectives
(installed after ``deepspeed.initialize``, as AgentClient does) so busy time tells the slow rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.trainer import collective_timer

CHILD = str(Path(__file__).with_name("collective_child.py"))
REPO = Path(__file__).resolve().parents[2]


def test_wrapped_calls_are_timed_once_and_async_waits_count() -> None:
    timer = collective_timer.CollectiveTimer()

    class Work:
        def wait(self) -> bool:
            time.sleep(0.05)
            return True

        def is_completed(self) -> bool:
            return True

    def inner(**_: object) -> None:
        time.sleep(0.02)

    wrapped_inner = timer.wrap("inner", inner)

    def outer(async_op: bool = False) -> Work:
        wrapped_inner()
        return Work()

    wrapped = timer.wrap("outer", outer)
    wrapped()
    assert timer.by_name == {"outer": 1}  # the nested call is part of the outer one
    assert 0.02 <= timer.take() < 0.5
    assert timer.take() == 0.0
    work = wrapped(async_op=True)
    assert work.is_completed() and work.wait() is True
    assert timer.take() >= 0.07 and timer.by_name["outer.wait"] == 1


def test_install_wraps_torch_distributed_and_uninstall_restores() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    collective_timer.uninstall()  # an in-process AgentClient of an earlier test may have installed it
    original = dist.all_reduce
    timer = collective_timer.install()
    try:
        assert collective_timer.install() is timer
        assert dist.all_reduce is not original and dist.all_reduce.__stalwart_timed__ is original
        assert distributed_c10d.all_reduce is dist.all_reduce
    finally:
        collective_timer.uninstall()
    assert dist.all_reduce is original and distributed_c10d.all_reduce is original


STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun world of 2 that runs a ZeRO-1, a ZeRO-2 and a ZeRO-3 engine in turn (the timer
    uninstalled before each ``deepspeed.initialize`` and installed after it)."""
    out = tmp_path_factory.mktemp("zero-collectives")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))}
    env.pop("STALWART_AGENT_SOCKET", None)
    steps = 8
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", CHILD,
           str(out), ",".join(map(str, STAGES)), str(steps)]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_zero_collectives_are_seen(zero_runs: Path, stage: int) -> None:
    ranks = [json.loads((zero_runs / f"rank-{r}-stage-{stage}.json").read_text()) for r in (0, 1)]
    assert [r["stage"] for r in ranks] == [stage, stage]
    print(stage, ranks[0]["by_name"])
    names = set(ranks[0]["by_name"])
    # ZeRO's gradient reduction and parameter all-gather both go through the wrapped functions
    assert names & {"all_reduce", "reduce_scatter_tensor", "reduce", "all_reduce_coalesced"}, names
    assert names & {"all_gather_into_tensor", "all_gather", "_all_gather_base", "broadcast"}, names
    # wall times are alike, busy times are not: rank 0 waits in collectives for the sleeping rank 1
    skip = 2  # warm-up steps
    busy = [sorted(w - b for w, b in zip(r["wall"][skip:], r["blocked"][skip:], strict=True)) for r in ranks]
    median = [b[len(b) // 2] for b in busy]
    print(f"stage {stage}: busy medians {median}")
    assert median[1] >= 0.15 * 0.9 and median[1] > median[0] + 0.1, median
