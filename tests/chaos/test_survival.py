"""The whole system under faults: the default scenario (CI) and the soak (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.chaos.netns import unavailable_reason
from stalwart.chaos.report import write
from stalwart.chaos.runner import Runner
from stalwart.chaos.scenario import load

SCENARIOS = Path(__file__).resolve().parents[2] / "chaos" / "scenarios"


def _run(name: str, tmp_path: Path, timeout: float, reference: bool = True) -> None:
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
    for fault in report.faults:
        assert fault.detection_s is not None and fault.recovery_s is not None, fault
    assert report.final_committed_step == scenario.job.steps
    assert paths["picture"].stat().st_size > 0


@pytest.mark.timeout(600)
def test_default_scenario_survives_one_fault_of_each_kind(tmp_path: Path) -> None:
    _run("default", tmp_path, timeout=420)


@pytest.mark.slow
@pytest.mark.timeout(5400)
def test_soak(tmp_path: Path) -> None:
    # No reference run: a fault-free twin of a 30-minute run would double it. Exactly-once data,
    # no lost commits and no corrupt loads are checked without one.
    _run("soak", tmp_path, timeout=5000, reference=False)
