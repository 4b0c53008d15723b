"""The whole system under faults: the default scenario (CI) and the soak (slow)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from stalwart.chaos.netns import unavailable_reason
from stalwart.chaos.report import RunReport, write
from stalwart.chaos.runner import Runner
from stalwart.chaos.scenario import FaultSpec, load
from stalwart.trainer import read_events

SCENARIOS = Path(__file__).resolve().parents[2] / "chaos" / "scenarios"


def _run(name: str, tmp_path: Path, timeout: float, reference: bool = True) -> RunReport:
    scenario = load(SCENARIOS / f"{name}.toml")
    lines: list[str] = []
    report = Runner(scenario, tmp_path / "work", progress=lines.append, timeout=timeout, reference=reference).run()
    paths = write(report, tmp_path / "report")
    failed = [name for name, ok in report.checks.items() if not ok]
    assert not failed, f"{failed}\n{paths['markdown'].read_text()}\n" + "\n".join(lines[-40:])
    # Without root the network and disk faults cannot exist here: they are skipped, and say so.
    needs_root = {"network-cut", "fill-disk"} if unavailable_reason() else set()
    assert {f.kind for f in report.faults} >= {f.kind for f in scenario.faults} - needs_root
    for kind in needs_root & {f.kind for f in scenario.faults}:
        assert any(kind in note and "root" in note for note in report.notes), report.notes
    moot = [f for f in report.faults if "no effect" in f.detail]  # e.g. its node was out of the world then
    assert len(moot) <= 1, moot
    for fault in report.faults:
        assert fault in moot or (fault.detection_s is not None and fault.recovery_s is not None), fault
    assert report.final_committed_step == scenario.job.steps
    # A NaN or a spike of the timeline is the loss of exactly its step, and the trainer faults there.
    faulted = {(e["step"], e["kind"]) for e in read_events(str(tmp_path / "work" / "run" / "steps.jsonl"))
               if e["event"] == "fault"}
    as_fault = {"nan-loss": "nonfinite_loss", "loss-spike": "spike"}
    for f in scenario.faults:
        if f.kind in as_fault:
            assert (f.at_step, as_fault[f.kind]) in faulted, (f, sorted(faulted))
    return report
    assert paths["picture"].stat().st_size > 0


@pytest.mark.timeout(600)
def test_default_scenario_survives_one_fault_of_each_kind(tmp_path: Path) -> None:
    _run("default", tmp_path, timeout=420)


@pytest.mark.timeout(300)
def test_training_health_scenario_rolls_back_nan_and_spike_and_excludes_a_2x_straggler(tmp_path: Path) -> None:
    """DeepSpeed ZeRO-2 on 3 nodes: NaN at step 45 and a spike at 130 each roll back (the record
    lists their skipped samples; exactly-once is checked with them); node1 slowed 2x is named a
    straggler and leaves the world at the next checkpoint (exclude_stragglers)."""
    report = _run("training-health", tmp_path, timeout=240)
    assert report.rollbacks == 2 and report.skipped_samples > 0
    assert report.stragglers == ["node1"]
    [excluded] = [r for r in report.rounds if "node1 drained by daemon" in r.reason]
    assert "straggler" in excluded.reason and excluded.world_size == 2
    slow = next(f for f in report.faults if f.kind == "slow-worker")
    assert slow.detected_at is not None and slow.detected_at <= excluded.t


@pytest.mark.timeout(300)
def test_a_job_past_its_rollback_limit_gives_up_and_the_run_says_why(tmp_path: Path) -> None:
    """With max_rollbacks = 1, a second NaN within the window stops the job (exit status 3); the
    daemon closes it, and the run ends at once with a failed report saying why (not a timeout)."""
    base = load(SCENARIOS / "training-health.toml")
    scenario = replace(base, cluster=replace(base.cluster, exclude_stragglers=False),
                       job=replace(base.job, steps=80, max_rollbacks=1),
                       faults=(FaultSpec("nan-loss", at_step=25, node="node0"),
                               FaultSpec("nan-loss", at_step=28, node="node1")))
    report = Runner(scenario, tmp_path / "work", progress=lambda line: None, timeout=240, reference=False).run()
    assert not report.passed and not report.checks["reached the last step"]
    assert report.rollbacks == 1
    [note] = [n for n in report.notes if "gave up" in n]
    assert "the job gave up at step 28" in note and "more than the 1 rollbacks allowed" in note, note
    assert not any("timed out" in n for n in report.notes), report.notes  # ended by the give-up, not the timeout
    assert any(r.reason.startswith("the job gave up") for r in report.rounds), report.rounds


@pytest.mark.slow
@pytest.mark.timeout(5400)
def test_soak(tmp_path: Path) -> None:
    # No reference run: a fault-free twin of a 30-minute run would double it. Exactly-once data,
    # no lost commits and no corrupt loads are checked without one.
    _run("soak", tmp_path, timeout=5000, reference=False)


@pytest.mark.timeout(300)
def test_a_dead_worker_with_no_warm_spare_shrinks_the_world_in_place_and_its_node_regrows_warm(
        tmp_path: Path) -> None:
    from stalwart.chaos.scenario import from_mapping

    scenario = from_mapping({
        "name": "shrink-to-replace", "seed": 1,
        "cluster": {"etcd_members": 1, "daemons": 1, "nodes": 3, "workers_per_node": 1, "lease_ttl": 2, "spares": 0},
        "job": {"steps": 150, "checkpoint_every": 5, "zero_stage": 1, "global_batch": 12, "micro_batch": 2,
                "step_time": 0.05, "samples": 2400},
        "fault": [{"kind": "kill-worker", "at_step": 25, "node": "node2"}],
    })
    report = Runner(scenario, tmp_path / "work", progress=lambda line: None, timeout=240, reference=False).run()
    assert all(report.checks.values()), report.checks
    [fault] = report.faults
    after = [r for r in report.rounds if r.t > fault.injected_at]
    assert after and after[0].world_size == 2, report.rounds
    assert "node2 left out while warming a replacement" in after[0].reason, after[0].reason
    # the survivors re-formed in place (no process started) and node2 came back with a warm spare
    assert any(r.world_size == 3 and "regrow" in r.reason for r in after[1:]), report.rounds
    node2 = (tmp_path / "work" / "run" / "node2.log").read_text()
    assert "no longer replacing a lost worker: 1 warm spare(s) ready" in node2
    assert "spare (pid" in node2 and "takes rank 2" in node2
    record = [json.loads(line) for line in (tmp_path / "work" / "run" / "steps.jsonl").read_text().splitlines()]
    reforms = [e for e in record if e.get("event") == "reform" and e.get("world_size") == 2]
    assert reforms, "the survivors did not re-form in place"
    print(f"shrink 3 -> 2: detected {fault.detection_s:.2f} s, resumed {fault.recovery_s:.2f} s")


@pytest.mark.timeout(600)
def test_overlapping_faults_do_not_cascade(tmp_path: Path) -> None:
    """A worker, an agent and the daemon leader in one step; a hang and an etcd member in one step;
    a network cut and a killed worker while a regrow's re-form is in flight: every fault is
    recovered on its own, no survivor is killed for waiting on a peer, no round is repeated."""
    report = _run("overlap", tmp_path, timeout=420, reference=False)
    logs = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "work" / "run").glob("node*.log"))
    assert "killing and replacing it" not in logs
    # A fault costs at most a shrink and a regrow; a cascade repeats rounds for one fault.
    assert len(report.rounds) <= 1 + 2 * len(report.faults), [r.reason for r in report.rounds]


@pytest.mark.timeout(600)
def test_control_plane_faults_cost_no_step(tmp_path: Path) -> None:
    """The control-plane scenario in short form (quorum lost for 8 s instead of 20): daemon
    leaders, an etcd member, an agent killed and one restarted the systemd way, and etcd's quorum
    lost. The workers train on through all of it: no round changes, no step is redone, and the
    killed and the restarted agents' successors adopt the same workers."""
    scenario = load(SCENARIOS / "controlplane.toml")
    faults = tuple(replace(f, duration=8.0) if f.kind == "lose-quorum" else f for f in scenario.faults)
    # The job outlasts the quorum loss (160 steps of at least 0.05 s from step 170) by a margin.
    scenario = replace(scenario, faults=faults, job=replace(scenario.job, steps=390))
    report = Runner(scenario, tmp_path / "work", progress=lambda line: None, timeout=480, reference=False).run()
    paths = write(report, tmp_path / "report")
    failed = [name for name, ok in report.checks.items() if not ok]
    assert not failed, f"{failed}\n{paths['markdown'].read_text()}"
    assert {f.kind for f in report.faults} == {f.kind for f in faults}
    assert [r.number for r in report.rounds] == [1], [r.reason for r in report.rounds]
    assert all(f.redone_steps == 0 for f in report.faults), paths["markdown"].read_text()
    run = tmp_path / "work" / "run"
    logs = {node: (run / f"{node}.log").read_text(errors="replace") for node in ("node1", "node2")}
    for node, text in logs.items():
        assert "adopted 1 worker(s) of round 1" in text, node
