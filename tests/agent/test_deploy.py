"""The shipped unit file and example configuration are valid."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.agent.config import AgentConfig, TLSConfig, load
from stalwart.coord.config import EtcdConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_example_agent_config_loads() -> None:
    config = load(DEPLOY / "agent.toml")
    assert config.workers == 8 and not config.insecure and not config.fault_injection


def test_the_example_agent_config_documents_every_setting() -> None:
    text = (DEPLOY / "agent.toml").read_text()
    for cls in (AgentConfig, TLSConfig, EtcdConfig):
        for name in cls.__dataclass_fields__:
            if name in ("tls", "etcd"):
                assert f"[{name}]" in text
            else:
                assert re.search(rf"^#? ?{name} = ", text, re.M), f"{cls.__name__}.{name} is not in deploy/agent.toml"


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


def _settings(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (DEPLOY / unit).read_text().splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_agent_unit_logs_survives_a_worker_oom_and_keeps_secrets_out_of_the_file() -> None:
    s = _settings("stalwart-agent.service")
    assert "--log-level info" in s["ExecStart"][0]  # the journal gets the agent's info lines
    assert s["OOMPolicy"] == ["continue"]  # one OOM-killed worker does not stop the unit
    assert s["EnvironmentFile"] == ["-/etc/stalwart/agent.env"]
    assert "PrivateDevices" not in s and "MemoryDenyWriteExecute" not in s  # GPUs and CUDA's JIT work
    assert s["DevicePolicy"] == ["closed"] and "char-nvidia* rw" in s["DeviceAllow"]


def test_the_service_user_is_created_by_the_sysusers_snippet(tmp_path: Path) -> None:
    snippet = DEPLOY / "sysusers.d" / "stalwart.conf"
    users = {line.split()[1] for line in snippet.read_text().splitlines() if line.startswith("u ")}
    for unit in ("stalwart-agent.service", "stalwart-daemon.service"):
        assert set(_settings(unit)["User"]) <= users, f"{unit} runs as a user nothing creates"
    if shutil.which("systemd-sysusers") is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    out = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(snippet)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "etc" / "passwd").read_text().startswith("stalwart:")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_agent_unit_is_hardened() -> None:
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(DEPLOY / "stalwart-agent.service")],
                         capture_output=True, text=True, timeout=60)
    if "Unknown option" in out.stderr or "unrecognized option" in out.stderr:
        pytest.skip("this systemd-analyze has no --offline")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout + out.stderr)
    assert match, out.stdout + out.stderr
    assert float(match.group(1)) <= 3.0, match.group(0)  # it was 8.9 EXPOSED


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_daemon_unit_is_hardened() -> None:
    s = _settings("stalwart-daemon.service")
    assert s["EnvironmentFile"] == ["-/etc/stalwart/daemon.env"]  # the etcd password stays out of the unit
    assert s["PrivateDevices"] == ["yes"] and s["CapabilityBoundingSet"] == [""]  # it needs no device, no capability
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(DEPLOY / "stalwart-daemon.service")],
                         capture_output=True, text=True, timeout=60)
    if "Unknown option" in out.stderr or "unrecognized option" in out.stderr:
        pytest.skip("this systemd-analyze has no --offline")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout + out.stderr)
    assert match, out.stdout + out.stderr
    assert float(match.group(1)) <= 2.0, match.group(0)  # it was 8.5 EXPOSED
