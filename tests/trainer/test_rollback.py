"""Training-health faults end to end with examples/train_gpt.py on real DeepSpeed (CPU, gloo): an
injected NaN or loss spike rolls back in-process to the checkpoint before it and skips its data;
repeated faults stop the job with EXIT_DIVERGED, also after a restart; fp16 overflow steps that
DeepSpeed skipped are no faults. Single-rank runs start the script without torchrun (≈ 4 s)."""

from __future__ import annotations

import collections
import math
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import REPO, Direct, start_rank, tail

from stalwart.ckpt import list_checkpoints
from stalwart.trainer import EXIT_DIVERGED, GlobalBatchSampler, committed_steps, read_events, skipped_samples
from stalwart.trainer.health import read_journal
from testkit import kill_tree

SCRIPT = str(REPO / "examples" / "train_gpt.py")
DATASET_LEN, GLOBAL_BATCH = 120, 12  # 10 steps per epoch
COMMON = ["--dataset-len", str(DATASET_LEN), "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "2",
          "--save-every", "4", "--dropout", "0"]
pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _solo(env: dict[str, str], d: Path, name: str, *args: str, fp16: bool = False) -> int:
    """One rank, no torchrun: the environment torchrun would give a world of one. ``fp16``: run
    the script through ``cpu_fp16.py`` (DeepSpeed allows fp16 on this CPU)."""
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    launcher = [str(Path(__file__).with_name("cpu_fp16.py"))] if fp16 else []
    cmd = [sys.executable, *launcher, SCRIPT, "--ckpt-dir", str(d / "ckpt"), "--steps-log", str(d / "steps.jsonl"),
           *COMMON, *args]
    proc = start_rank(cmd, {**env, **world}, d / f"{name}.log")
    try:
        code = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise
    assert code is not None, f"{name}: exit status unknown"
    return code


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def _check_accounting(events: list[dict[str, Any]], last_step: int) -> dict[int, collections.Counter[int]]:
    """Committed steps are 1..last_step with finite losses; per epoch, no sample is both used and
    skipped, and none is used twice. Returns the samples used per epoch."""
    committed = committed_steps(events)
    assert sorted(committed) == list(range(1, last_step + 1))
    assert all(math.isfinite(e["loss"]) for e in committed.values())
    used: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for e in committed.values():
        used[int(e["epoch"])].update(e["samples"])
    skipped = skipped_samples(events)
    for epoch, counts in used.items():
        assert max(counts.values()) == 1, epoch
        assert not set(counts) & set(skipped.get(epoch, [])), epoch
    return used


def test_injected_nan_on_one_rank_rolls_back_both_and_skips_the_data_since_the_checkpoint(
        direct_jobs: Direct, tmp_path: Path) -> None:
    """NaN on rank 1 at step 8, a checkpoint step: nothing of step 8 is saved; both ranks go back
    to step 4, skip the batches of steps 5..8 and train on to step 16."""
    log = tmp_path / "run.log"
    rc = direct_jobs.run(2, SCRIPT, "--ckpt-dir", str(tmp_path / "ckpt"), "--steps-log", str(tmp_path / "s.jsonl"),
                           *COMMON, "--steps", "16", "--inject-nan-step", "8", "--inject-rank", "1", log=log)
    assert rc == 0, tail(log)
    events = read_events(str(tmp_path / "s.jsonl"))
    (fault,) = _of(events, "fault")
    (rollback,) = _of(events, "rollback")
    assert (fault["step"], fault["kind"]) == (8, "nonfinite_loss")
    assert (rollback["step"], rollback["fault_step"], rollback["skipped_steps"]) == (4, 8, [5, 6, 7, 8])
    assert [e["step"] for e in _of(events, "restore")] == [0]  # in-process: no restart
    # where it came from, as a restore record says (a chaos run checks no corrupt byte was read)
    assert rollback["world_host_bytes"] + rollback["world_peer_bytes"] + rollback["world_disk_bytes"] > 0
    assert rollback["disk_bytes"] + rollback["host_bytes"] > 0
    # the faulty step was never checkpointed: the only commit of step 8 comes after the rollback
    at = events.index(rollback)
    assert [e["step"] for e in _of(events[:at], "commit")] == [4]
    assert [e["step"] for e in _of(events[at:], "commit")] == [8, 12, 16]
    # the skipped samples are those the steps 5..8 before the fault had used, the fault's batch last
    before = {e["step"]: e["samples"] for e in _of(events[:at], "step")}
    assert rollback["skipped_samples"] == [*before[5], *before[6], *before[7], *fault["samples"]]
    assert skipped_samples(events) == {0: sorted(rollback["skipped_samples"])}
    used = _check_accounting(events, 16)
    # epoch 0: 6 batches trained + 4 skipped = every sample once; epoch 1 (steps 7..16) whole
    assert sorted([*used[0], *skipped_samples(events)[0]]) == list(range(DATASET_LEN))
    assert used[1] == collections.Counter(range(DATASET_LEN))
    assert [c.step for c in list_checkpoints(str(tmp_path / "ckpt")) if c.committed] == [8, 12, 16]
    assert "rank 1 step 8: injected fault nan" in log.read_text()


def test_injected_spike_rolls_back_and_skips_only_the_last_batch(ds_env: dict[str, str], tmp_path: Path) -> None:
    """A spike at step 7 (x30): back to step 4, only batch 7 skipped (``--skip last_k``), steps 5
    and 6 retrained on the same samples with bitwise the same losses (the restore is exact)."""
    rc = _solo(ds_env, tmp_path, "run", "--steps", "12", "--inject-spike-step", "7", "--spike-factor", "30",
               "--spike-min-history", "5", "--skip", "last_k", "--skip-last", "1")
    assert rc == 0, tail(tmp_path / "run.log")
    events = read_events(str(tmp_path / "steps.jsonl"))
    (fault,) = _of(events, "fault")
    (rollback,) = _of(events, "rollback")
    assert (fault["step"], fault["kind"]) == (7, "spike") and "MADs above the median" in fault["reason"]
    assert (rollback["step"], rollback["skipped_steps"]) == (4, [7])
    assert rollback["skipped_samples"] == fault["samples"]
    at = events.index(rollback)
    first = {e["step"]: e for e in _of(events[:at], "step")}
    again = {e["step"]: e for e in _of(events[at:], "step")}
    assert sorted(again) == list(range(5, 13))
    for k in (5, 6):
        assert (k, again[k]["samples"], again[k]["loss"]) == (k, first[k]["samples"], first[k]["loss"])
    # the new step 7 trains on the batch after the skipped one: positions 84..95 of epoch 0's order
    order = GlobalBatchSampler(DATASET_LEN, GLOBAL_BATCH, 2, 1, 0, seed=0).epoch_order(0)
    assert fault["samples"] == order[72:84] and again[7]["samples"] == order[84:96]
    used = _check_accounting(events, 12)
    assert sorted([*used[0], *skipped_samples(events)[0]]) == list(range(DATASET_LEN))

    # Restart from step 12 without the journal: the checkpoint alone carries the rollback (its
    # skipped window) and the loss history, so a spike right after the restart is caught at once.
    (tmp_path / "ckpt" / "health-rollbacks.json").unlink()
    rc = _solo(ds_env, tmp_path, "run2", "--steps", "16", "--inject-spike-step", "13", "--spike-factor", "30",
               "--spike-min-history", "5", "--skip", "last_k", "--skip-last", "1")
    assert rc == 0, tail(tmp_path / "run2.log")
    events2 = read_events(str(tmp_path / "steps.jsonl"))[len(events):]
    assert [(e["event"], e["step"]) for e in events2 if e["event"] in ("restore", "fault", "rollback")] == [
        ("restore", 12), ("fault", 13), ("rollback", 12)]
    assert events2[0]["rollbacks"] == 1
    assert len(read_journal(str(tmp_path / "ckpt"))) == 2
    _check_accounting(events + events2, 16)


def test_repeated_faults_beyond_the_limit_stop_with_exit_status_3_also_after_a_restart(
        ds_env: dict[str, str], tmp_path: Path) -> None:
    """--max-rollbacks 1: NaN at 6 rolls back to 4; NaN at 7 is one fault too many. A restart
    (which restores step 4, saved before the rollback) still knows, from the journal, the rollback
    and its skipped data: its first fault stops it at once."""
    rc = _solo(ds_env, tmp_path, "run1", "--steps", "16", "--max-rollbacks", "1",
               "--inject-nan-step", "6", "--inject-nan-step", "7")
    assert rc == EXIT_DIVERGED == 3, tail(tmp_path / "run1.log")
    events = read_events(str(tmp_path / "steps.jsonl"))
    assert [(e["fault_step"], e["step"]) for e in _of(events, "rollback")] == [(6, 4)]
    (gave_up,) = _of(events, "gave_up")
    assert gave_up["step"] == 7 and gave_up["rollbacks"] == 1 and gave_up["max_rollbacks"] == 1
    assert "more than the 1 rollbacks allowed" in gave_up["reason"] and "loss is nan" in gave_up["reason"]
    assert [c.step for c in list_checkpoints(str(tmp_path / "ckpt")) if c.committed] == [4]
    assert "TrainingDiverged" not in (tmp_path / "run1.log").read_text()  # caught: no traceback

    rc = _solo(ds_env, tmp_path, "run2", "--steps", "16", "--max-rollbacks", "1", "--inject-nan-step", "5")
    assert rc == EXIT_DIVERGED, tail(tmp_path / "run2.log")
    events2 = read_events(str(tmp_path / "steps.jsonl"))[len(events):]
    assert [(e["event"], e["step"]) for e in events2 if e["event"] != "step"] == [
        ("restore", 4), ("fault", 5), ("gave_up", 5)]
    # the data of steps 5..6 that run 1 skipped stays skipped: step 5 of run 2 is run 1's second step 5
    run1_steps = [e for e in _of(events, "step") if e["step"] == 5]
    assert _of(events2, "fault")[0]["samples"] == run1_steps[-1]["samples"] != run1_steps[0]["samples"]


def test_a_fault_before_the_first_checkpoint_stops_the_job(ds_env: dict[str, str], tmp_path: Path) -> None:
    """Nothing to roll back to (the initial weights are not saved): the job stops, saying why."""
    rc = _solo(ds_env, tmp_path, "run", "--steps", "8", "--inject-nan-step", "3")
    assert rc == EXIT_DIVERGED, tail(tmp_path / "run.log")
    events = read_events(str(tmp_path / "steps.jsonl"))
    assert [e["event"] for e in events] == ["restore", "step", "startup", "step", "fault", "gave_up"]
    assert "no good checkpoint before step 3" in events[-1]["reason"]
    assert list_checkpoints(str(tmp_path / "ckpt")) == []


def test_fp16_overflow_steps_deepspeed_skipped_are_not_faults(ds_env: dict[str, str], tmp_path: Path) -> None:
    """A loss scale of 2**24 overflows fp16 gradients: DeepSpeed drops those updates (grad norm
    inf) and lowers the scale. They are recorded as steps, not rolled back."""
    rc = _solo(ds_env, tmp_path, "run", "--steps", "9", "--fp16", "--initial-scale-power", "24",
               fp16=True)
    assert rc == 0, tail(tmp_path / "run.log")
    events = read_events(str(tmp_path / "steps.jsonl"))
    assert _of(events, "fault") == [] and _of(events, "rollback") == []
    overflowed = [e for e in _of(events, "step") if e.get("update_skipped")]
    assert len(overflowed) >= 2 and all(e["grad_norm"] == math.inf for e in overflowed)
    assert any(not e.get("update_skipped") for e in _of(events, "step"))
    _check_accounting(events, 9)


def test_a_rollback_takes_the_memory_generation_before_the_fault_and_trains_on_as_from_a_checkpoint_there(
        direct_jobs: Direct, tmp_path: Path) -> None:
    """Memory generations after every step (``--memory-every 1``), saves every 4: a NaN on rank 1
    at step 7 rolls both ranks back to step 6 from host memory (no byte read from storage, no
    step redone) and skips only batch 7. The run then matches, loss for loss, one that saved step
    6 and rolled back to that checkpoint."""
    runs = {}
    for name, args in (("memory", ["--save-every", "4", "--memory-every", "1"]),
                       ("storage", ["--save-every", "2", "--memory-every", "0"])):
        d = tmp_path / name
        d.mkdir()
        rc = direct_jobs.run(2, SCRIPT, "--ckpt-dir", str(d / "ckpt"), "--steps-log", str(d / "s.jsonl"),
                             *COMMON, *args, "--steps", "12", "--inject-nan-step", "7", "--inject-rank", "1",
                             log=d / "run.log")
        assert rc == 0, tail(d / "run.log")
        runs[name] = read_events(str(d / "s.jsonl"))
    for name, events in runs.items():
        (rollback,) = _of(events, "rollback")
        assert (rollback["step"], rollback["fault_step"], rollback["skipped_steps"]) == (6, 7, [7]), name
        _check_accounting(events, 12)
    memory, storage = (_of(runs[n], "rollback")[0] for n in ("memory", "storage"))
    assert (memory["source"], memory["world_disk_bytes"]) == ("memory", 0) and memory["world_host_bytes"] > 0
    assert storage["source"] == "storage"  # the checkpoint of step 6 (from its host copy)
    after = {n: {e["step"]: e["loss"] for e in _of(runs[n][runs[n].index(_of(runs[n], "rollback")[0]):], "step")}
             for n in runs}
    assert sorted(after["memory"]) == list(range(7, 13))
    assert after["memory"] == after["storage"]  # bitwise: the same state and data as from the checkpoint
