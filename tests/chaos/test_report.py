"""The chaos report: goodput arithmetic and the three files."""

from __future__ import annotations

import json
from pathlib import Path

from stalwart.chaos.report import FaultRecord, RestoreSource, RoundChange, RunReport, Sample, goodput, write


def _run() -> RunReport:
    # round 1: steps 0..9 at 1 step/s; fault at 10.5 s; round 2 restores step 5 and redoes 6..19
    samples = [Sample(t=float(i), step=i, world=3, round=1) for i in range(10)]
    samples += [Sample(t=14.0 + j, step=6 + j, world=2, round=2) for j in range(14)]
    report = RunReport(scenario="unit", wall_s=30.0, target_steps=20, samples=samples,
                       faults=[FaultRecord("kill-worker", "node2", 10.5, detected_at=10.6, resumed_at=14.0)],
                       rounds=[RoundChange(0.0, 1, 3, "first round"), RoundChange(12.0, 2, 2, "node2 lost")],
                       final_committed_step=19, checks={"reached last step": True})
    return report


def test_goodput_counts_each_committed_step_once_by_its_last_run() -> None:
    report = _run()
    # 20 committed steps of 1 s each (steps 6..9 run twice: the first runs are wasted) over 30 s
    assert goodput(report.samples, 19, 30.0) == 20 / 30
    assert goodput(report.samples, 9, 30.0) == 10 / 30  # steps above the last commit do not count
    assert goodput([], 5, 10.0) == 0.0


def test_files(tmp_path: Path) -> None:
    report = _run()
    report.startup_phases = {"cluster up, first round, spawn": 1.5, "imports": 2.25, "world": 0.5}
    report.restores = [RestoreSource(4.0, 10, 2, 100, 50, 0),
                       RestoreSource(9.0, 17, 2, 100, 50, 0, "memory generation")]
    paths = write(report, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["passed"] is True and data["faults"][0]["recovery_s"] == 3.5
    assert abs(data["faults"][0]["detection_s"] - 0.1) < 1e-9
    md = paths["markdown"].read_text()
    assert "PASSED" in md and "kill-worker" in md and "timeline.png" in md
    assert "cluster up, first round, spawn 1.50 s, imports 2.25 s, world 0.50 s." in md
    assert data["startup_phases"]["imports"] == 2.25
    assert "| 4.00 | 10 | checkpoint | 2 | 100 | 50 | 0 |" in md and "| 9.00 | 17 | memory generation | 2 |" in md
    assert paths["picture"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.checks["no corrupt load"] = False
    assert not report.passed
