"""Licence and optional dependencies: matplotlib (stalwart[chaos]) and nvidia-ml-py (stalwart[gpu])
are extras, and stalwart works without them, saying which extra to install where one is needed."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WITHOUT_EXTRAS = "import sys; sys.modules['matplotlib'] = None; sys.modules['pynvml'] = None\n"


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS + code], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_the_licence_is_the_apache_2_text_pyproject_names() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}


def test_matplotlib_and_nvml_are_extras_and_the_tests_pull_chaos() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    assert not names & {"matplotlib", "nvidia-ml-py"}
    extras = project["optional-dependencies"]
    assert extras["chaos"] == ["matplotlib>=3.8"] and extras["gpu"] == ["nvidia-ml-py>=12"]
    assert "stalwart[chaos]" in extras["test"]


def test_without_the_extras_the_agent_runs_and_says_which_extra_is_missing(tmp_path: Path) -> None:
    out = _run("""
from stalwart.agent.health import FakeProbe, ProbeUnavailable, make_probe
import stalwart.agent.node, stalwart.daemon.loop, stalwart.chaos.runner, stalwart.cli.main
assert isinstance(make_probe("auto", 2), FakeProbe)
try:
    make_probe("nvml", 2)
except ProbeUnavailable as exc:
    print("NVML:", exc)
""", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "NVML: " in out.stdout and "pip install 'stalwart[gpu]'" in out.stdout, out.stdout


def test_without_matplotlib_a_chaos_report_is_written_without_its_picture(tmp_path: Path) -> None:
    out = _run(f"""
from pathlib import Path
from stalwart.chaos.report import MissingExtra, RunReport, plot, write
report = RunReport(scenario="s", wall_s=1.0, target_steps=10)
paths = write(report, Path({str(tmp_path)!r}))
assert "picture" not in paths and paths["json"].exists() and paths["markdown"].exists(), paths
try:
    plot(report, Path({str(tmp_path / 'x.png')!r}))
except MissingExtra as exc:
    print("PLOT:", exc)
""", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "pip install 'stalwart[chaos]'" in out.stdout, out.stdout
