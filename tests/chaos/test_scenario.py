"""Scenario files: parsing, validation that names the setting, seeded random timelines."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from stalwart.chaos.runner import _reference_of
from stalwart.chaos.scenario import FAULT_KINDS, ScenarioError, from_mapping, load

GOOD = """
name = "t"
seed = 3
[cluster]
nodes = 3
[job]
steps = 50
[[fault]]
kind = "kill-worker"
at_step = 10
node = "node1"
[[fault]]
kind = "gpu-fault"
at_time = 4.5
code = 79
[random]
rate_per_minute = 6
kinds = ["kill-worker", "hang-worker"]
duration_s = 120
"""


def test_load_and_replayable_random_faults(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(GOOD)
    s = load(path)
    assert [f.kind for f in s.faults] == ["kill-worker", "gpu-fault"]
    assert s.faults[0].node == "node1" and s.faults[1].at_time == 4.5
    first, second = s.random_faults(), load(path).random_faults()
    assert first == second and len(first) > 3
    assert all(f.kind in ("kill-worker", "hang-worker") and f.node in s.node_names() for f in first)
    assert all(0 < f.at_time < 120 for f in first)  # type: ignore[operator]


@pytest.mark.parametrize("data", [
    {"clutser": {}},
    {"cluster": {"nodez": 3}},
    {"fault": [{"kind": "meteor", "at_step": 1}]},
    {"fault": [{"kind": "kill-worker"}]},
    {"fault": [{"kind": "kill-worker", "at_step": 1, "at_time": 2.0}]},
    {"fault": [{"kind": "kill-worker", "at_step": 1, "node": "node9"}]},
    {"job": {"zero_stage": 4}},
    {"cluster": {"nodes": 2, "min_nodes": 3}},
    {"random": {"kinds": ["nope"]}},
])
def test_bad_scenarios_name_the_setting(data: dict[str, object]) -> None:
    with pytest.raises(ScenarioError):
        from_mapping(data)


def test_every_fault_kind_is_accepted() -> None:
    s = from_mapping({"fault": [{"kind": k, "at_step": i} for i, k in enumerate(FAULT_KINDS)]})
    assert [f.kind for f in s.faults] == list(FAULT_KINDS)


def test_broken_toml(tmp_path: Path) -> None:
    (tmp_path / "b.toml").write_text("name = [")
    with pytest.raises(ScenarioError):
        load(tmp_path / "b.toml")


def test_uses_sees_the_timeline_and_the_random_kinds() -> None:
    s = from_mapping({"fault": [{"kind": "fill-disk", "at_step": 3}], "random": {"kinds": ["network-cut"]}})
    assert s.uses("fill-disk") and s.uses("network-cut") and not s.uses("kill-agent")
    with pytest.raises(ScenarioError, match="cluster.checkpoint_fs_mb"):
        from_mapping({"cluster": {"checkpoint_fs_mb": 1}})


def test_a_runs_default_timeout_outlasts_the_scenarios_random_faults() -> None:
    from stalwart.cli.chaos_cmd import default_timeout

    shipped = Path(__file__).resolve().parents[2] / "chaos" / "scenarios"
    soak = load(shipped / "soak.toml")
    assert soak.random is not None and default_timeout(soak) >= soak.random.duration_s + 600
    assert default_timeout(load(shipped / "default.toml")) == 900.0


def test_a_worker_fault_aimed_at_a_cut_or_absent_node_goes_to_a_member_that_can_be_told() -> None:
    from stalwart.chaos.runner import fault_target
    from stalwart.chaos.scenario import FaultSpec

    members = ["node0", "node1", "node2"]
    kill = FaultSpec(kind="kill-worker", at_step=10, node="node0")
    assert fault_target(kill, members, set()) == "node0"
    # node0's link is cut: a call to its agent would hold the runner until its deadline
    assert fault_target(kill, members, {"node0"}) == "node1"
    assert fault_target(kill, ["node1", "node2"], set()) == "node1"  # node0 is out of the world
    assert fault_target(kill, members, set(members)) == "node0"  # nobody to take it: tried (and retried) there
    # Faults on the node itself (not on a worker) stay where they were aimed.
    cut = FaultSpec(kind="network-cut", at_step=10, node="node0")
    assert fault_target(cut, members, {"node0"}) == "node0"


def test_a_job_memory_every_below_zero_is_refused_by_name() -> None:
    with pytest.raises(ScenarioError, match="job.memory_every"):
        from_mapping({"job": {"memory_every": -1}})


def test_the_fault_free_twin_runs_only_as_far_as_its_losses_are_compared() -> None:
    health = load(Path(__file__).resolve().parents[2] / "chaos" / "scenarios" / "training-health.toml")
    twin = _reference_of(health)
    assert (twin.faults, twin.random, twin.job.steps) == ((), None, 45 + 5)  # its first NaN is at step 45
    assert replace(twin.job, steps=health.job.steps) == health.job
    plain = from_mapping({"name": "p", "job": {"steps": 50}, "fault": [{"kind": "kill-worker", "at_step": 10}]})
    assert _reference_of(plain).job.steps == 50
    maybe_nan = from_mapping({"name": "r", "job": {"steps": 50}, "fault": [{"kind": "nan-loss", "at_step": 10}],
                              "random": {"rate_per_minute": 1, "kinds": ["nan-loss"], "duration_s": 60}})
    assert _reference_of(maybe_nan).job.steps == 50  # a random NaN may come anywhere
