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
@pytest.mark.parametrize("unit", ["stalwart-agent.service", "stalwart-daemon.service"])
def test_units_verify(tmp_path: Path, unit: str) -> None:
    text = (DEPLOY / unit).read_text()
    for needed in ("Type=notify", "WatchdogSec=", "Restart=", "User=", "LimitNOFILE="):
        assert needed in text, f"{unit} lacks {needed}"
    # verify checks that ExecStart's program exists: point it at this installation's
    local = tmp_path / unit
    local.write_text(text.replace("/usr/local/bin/stalwart", str(Path(sys.executable).with_name("stalwart"))))
    out = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
