"""The agent's /metrics listens where the operator says (metrics_host; default: listen's host), not
always on every interface. A real agent against a real etcd; the bound address is read from the OS."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from stalwart.agent.config import AgentConfig
from stalwart.agent.node import NodeAgent
from stalwart.coord.local import LocalEtcd

WORKER = str(Path(__file__).with_name("worker_script.py"))


def _listening_ip(port: int) -> str:
    [conn] = [c for c in psutil.Process().net_connections(kind="tcp")
              if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    return str(conn.laddr.ip)


@pytest.mark.parametrize(("metrics_host", "expected"), [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_metrics_bind_to_metrics_host(etcd_server: LocalEtcd, tmp_path: Path,
                                      start_agent: Callable[[AgentConfig], NodeAgent],
                                      metrics_host: str | None, expected: str) -> None:
    agent = start_agent(AgentConfig(
        job=f"metrics-{expected.replace('.', '-')}", node_id="m0", command=(sys.executable, WORKER), insecure=True,
        listen="127.0.0.1:0", etcd=etcd_server.client_config(), state_dir=str(tmp_path / "state"), lease_ttl=2,
        probe="fake", metrics_port=0, metrics_host=metrics_host))
    assert _listening_ip(agent.metrics_port) == expected
    body = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5).read().decode()
    assert "stalwart_agent_round" in body
