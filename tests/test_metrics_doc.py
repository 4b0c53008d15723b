"""docs/metrics.md is the metrics contract: a running agent and daemon export every metric it
lists, and the Grafana dashboard and the alert rules use only metrics it lists (the table is
parsed, so the doc, the code and the dashboards cannot drift apart)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "metrics.md"
DASHBOARD = REPO / "deploy" / "grafana" / "stalwart.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
_NAME = re.compile(r"\bstalwart_[a-z_]+\b")
_SUFFIXES = ("_bucket", "_count", "_sum")


def documented() -> dict[str, str]:
    """``{metric: source}`` from the doc's table (rows whose first cell is a metric name)."""
    out: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"`stalwart_[a-z_]+`", cells[0]):
            assert cells[3] in ("agent", "daemon"), line
            out[cells[0].strip("`")] = cells[3]
    assert len(out) >= 20, "the table in docs/metrics.md was not found"
    return out


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _used(expr: str) -> set[str]:
    return {_base(n) for n in _NAME.findall(expr)}


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    exprs = []
    ids = set()
    for panel in dash["panels"]:
        assert {"id", "type", "title", "gridPos", "targets"} <= panel.keys(), panel.get("title")
        assert panel["id"] not in ids
        ids.add(panel["id"])
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["targets"], f"panel {panel['title']} has no query"
        for target in panel["targets"]:
            assert target["refId"] and target["expr"]
            exprs.append(target["expr"])
    return exprs


def _alert_rules() -> list[dict[str, object]]:
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [rule for group in doc["groups"] for rule in group["rules"]]
    for rule in rules:
        assert {"alert", "expr", "labels", "annotations"} <= rule.keys(), rule
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
    names = {r["alert"] for r in rules}
    for needed in ("StalwartNoStepProgress", "StalwartCheckpointTooOld", "StalwartQuarantineRate"):
        assert needed in names
    return rules


def test_the_dashboard_and_the_alerts_use_only_documented_metrics() -> None:
    known = set(documented())
    for expr in _dashboard_exprs():
        used = _used(expr)
        assert used, f"a dashboard query uses no stalwart metric: {expr}"
        assert used <= known, f"undocumented metrics in the dashboard: {sorted(used - known)}"
    for rule in _alert_rules():
        used = _used(str(rule["expr"]))
        assert used and used <= known, f"alert {rule['alert']}: undocumented metrics {sorted(used - known)}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt-get install prometheus)")
def test_the_alert_rules_and_the_dashboard_queries_parse(tmp_path: Path) -> None:
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # every dashboard query as a recording rule: promtool parses its PromQL
    exprs = [e.replace("$__rate_interval", "5m") for e in _dashboard_exprs()]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query{i}", "expr": e}
                                                        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _exported(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(_base(re.split(r"[{ ]", line, maxsplit=1)[0]))
    return names


def test_a_running_agent_and_daemon_export_every_documented_metric(etcd_server, etcd_client, tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "tests" / "daemon"))
    from daemon_testlib import AGENT_TESTS, DaemonProc, RoundLog, agent_process, new_job, stop_processes

    from stalwart.coord.local import free_port
    from testkit import wait_for

    job = new_job()
    rounds = RoundLog(etcd_client, job)
    daemon = DaemonProc(etcd_server.endpoints, job, tmp_path / "d.log", "d1", "--min-nodes", "2", "--max-nodes", "2")
    ports = {n: free_port() for n in ("m0", "m1")}
    agents = [agent_process(etcd_server.endpoints[0], job, n, tmp_path, str(AGENT_TESTS / "gloo_worker.py"),
                            extra=f"metrics_port = {ports[n]}", env={"CKPT_EVERY": "5", "WORK": "0.01"})
              for n in ports]
    try:
        rounds.wait_number(1, timeout=60)
        wait_for(lambda: "stalwart_agent_last_checkpoint_timestamp_seconds{" in _scrape(ports["m0"]) and
                 "stalwart_daemon_job_step 0.0" not in _scrape(daemon.metrics_port), 90,
                 "steps and a checkpoint", tmp_path, retry_on=(OSError,))
        agent = set.union(*(_exported(_scrape(p)) for p in ports.values()))
        wait_for(lambda: "stalwart_daemon_last_checkpoint_timestamp_seconds 0.0" not in _scrape(daemon.metrics_port),
                 60, "the daemon to see a checkpoint", tmp_path)
        daemon_names = _exported(_scrape(daemon.metrics_port))
        for name, source in documented().items():
            have = agent if source == "agent" else daemon_names
            assert name in have, f"{name} ({source}) is documented in docs/metrics.md but not exported"
    finally:
        stop_processes(agents)
        daemon.stop()
        rounds.close()
