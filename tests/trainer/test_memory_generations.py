"""Memory generations: a lost rank restored at the step it died, from peers' memory.

Three ranks on three simulated nodes (``STALWART_NODE``) take a memory generation after every
step that is not a save (``PeerConfig.memory_every=1``; saves every 3 steps). The rank on node n2
is SIGKILLed after step 8 (once its part of step 8 has reached its buddy), and the survivors
re-form 3 -> 2: they must restore step 8, not the checkpoint of step 6, read nothing from storage,
and equal, bitwise, a run that saved step 8 to storage without failing and restarted from it at
world size 2: the restored state and every later loss. Where the lost rank's part is held by no
one (every rank on one node: no buddy), the generation is incomplete and the world restores the
checkpoint from storage instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_reform import STEPS, Harness, assert_same_as_restart, free_port, lose_rank_2, print_timings, restart_reference

KILL_AT = 8  # a memory generation's step (8 is no save: those are 3, 6, 9, 12)
COMMITTED = 6


@pytest.fixture
def jobs() -> list[Harness]:
    made: list[Harness] = []
    yield made  # type: ignore[misc]
    for h in made:
        h.close()


def _restores(job: Harness) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in job.steps_log.read_text().splitlines()]
    return [e for e in events if e["event"] == "restore" and e.get("world_size") == 2]


# ZeRO-3's fill from memory is the same as the buddy replicas' (test_peer_restore z3): -m slow
@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)], ids=["z1", "z3"])
def test_a_lost_rank_is_restored_at_its_last_step_from_memory_and_matches_a_saved_run_bitwise(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness], stage: int) -> None:
    common = ("--zero-stage", str(stage))
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    kill_time, results = lose_rank_2(job, KILL_AT, (*common, "--memory-every", "1"))
    print_timings(f"3->2 kill, memory generations, ZeRO-{stage}", kill_time, results)
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        (t,) = res["reforms"]
        assert t["restored_step"] == KILL_AT and res["step"] == STEPS, (name, t)
        assert t["disk_bytes"] == 0, (name, t, job.logs())
    (restore,) = _restores(job)
    assert restore["source"] == "memory" and restore["step"] == KILL_AT and restore["saved_world_size"] == 3
    assert restore["world_disk_bytes"] == 0 and restore["world_peer_bytes"] > 0  # node n2's part came from rank 0

    # The same run without a fault, saving step 8 to storage, restarted from it at world size 2.
    full = Harness(tmp_path, ds_env, "unfailed")
    jobs.append(full)
    port = free_port()
    for r in range(3):
        full.start(f"f{r}", rank=r, world=3, port=port,
                   extra=(*common, "--node", f"n{r}", "--steps", str(KILL_AT), "--save-every", "4"))
    full.wait(["f0", "f1", "f2"])
    ref = restart_reference(jobs, full, ds_env, tmp_path, common, step=KILL_AT, nodes=True)
    assert_same_as_restart(job, "w0", ref, KILL_AT)
    losses = job.losses()
    # Before the fault the job's own losses agree with the unfailed run's (one trajectory).
    assert {s: losses[s] for s in range(1, KILL_AT + 1)} == {s: full.losses()[s] for s in range(1, KILL_AT + 1)}


def test_a_generation_whose_lost_part_no_one_holds_falls_back_to_the_checkpoint_in_storage(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness]) -> None:
    """Every rank on one node: no buddy holds rank 2's parts, so its generation of step 8 died
    with it; the survivors still have theirs, and must not restore an incomplete step."""
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    _, results = lose_rank_2(job, KILL_AT, ("--memory-every", "1"), nodes=("n0", "n0", "n0"))
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        (t,) = res["reforms"]
        assert t["restored_step"] == COMMITTED and res["step"] == STEPS, (name, t)
    (restore,) = _restores(job)
    assert restore["source"] == "storage" and restore["step"] == COMMITTED and restore["world_disk_bytes"] > 0
