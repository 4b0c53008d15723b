"""The shipped unit file and example configuration are valid."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.agent.config import load

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_example_agent_config_loads() -> None:
    config = load(DEPLOY / "agent.toml")
    assert config.workers == 8 and not config.insecure and not config.fault_injection


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_agent_unit_verifies(tmp_path: Path) -> None:
    unit = (DEPLOY / "stalwart-agent.service").read_text()
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "Restart=" in unit and "User=" in unit
    # verify checks that ExecStart's program exists: point it at this installation's
    local = tmp_path / "stalwart-agent.service"
    local.write_text(unit.replace("/usr/local/bin/stalwart", str(Path(sys.executable).with_name("stalwart"))))
    out = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
