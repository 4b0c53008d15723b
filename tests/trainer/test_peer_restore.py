"""A lost node restored from peer memory: real processes, gloo and DeepSpeed (ZeRO-1 and ZeRO-2).

Three ranks on three simulated nodes (``STALWART_NODE``); each pushes its part of every committed
checkpoint to its buddy on the next node. The rank on node n2 is SIGKILLed (after its replica of
step 6 has reached its buddy) and the survivors re-form 3 -> 2: nothing of the state may come
from storage, and the re-formed run must equal, bitwise, a run freshly started at world size 2
from the checkpoint on disk: the restored state and every later loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_reform import RESTORED, STEPS, Harness, assert_same_as_restart, lose_rank_2, print_timings, restart_reference


@pytest.fixture
def jobs() -> list[Harness]:
    made: list[Harness] = []
    yield made  # type: ignore[misc]
    for h in made:
        h.close()


# ZeRO-2 partitions like ZeRO-1 for this restore: a soak-tier variant (-m slow)
@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow), 3], ids=["z1", "z2", "z3"])
def test_a_lost_node_is_restored_from_peer_memory_without_reading_storage(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness], stage: int) -> None:
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    common = ("--zero-stage", str(stage))
    kill_time, results = lose_rank_2(job, 7, common)
    print_timings(f"3->2 kill, peers, ZeRO-{stage}", kill_time, results)
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        (t,) = res["reforms"]
        assert t["restored_step"] == RESTORED and res["step"] == STEPS
        assert t["disk_bytes"] == 0, (name, t, job.logs())
        assert t["host_bytes"] > 0 and t["peer_bytes"] > 0, (name, t)
    # Rank 0 held n2's replica; rank 1 pulled it (and rank 0 pulled rank 1's own part).
    restore = [e for e in job_events(job) if e["event"] == "restore" and e.get("world_size") == 2]
    assert restore and restore[0]["world_disk_bytes"] == 0 and restore[0]["world_peer_bytes"] > 0

    ref = restart_reference(jobs, job, ds_env, tmp_path, common, nodes=True)
    assert_same_as_restart(job, "w0", ref)


def test_without_peer_replicas_the_lost_ranks_part_is_read_from_storage(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness]) -> None:
    """The same loss with ``PeerConfig(replicas=0)``: the dead rank's part can only come from disk
    (the test above fails its ``disk_bytes == 0`` for the same reason when replication is off)."""
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    _, results = lose_rank_2(job, 7, ("--no-peers",))
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        (t,) = res["reforms"]
        assert t["peer_bytes"] == 0
    assert sum(res["reforms"][0]["disk_bytes"] for res in results.values()) > 0


def job_events(job: Harness) -> list[dict[str, object]]:
    import json

    return [json.loads(line) for line in job.steps_log.read_text().splitlines()]
