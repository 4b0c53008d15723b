"""deploy/k8s/ validates against the Kubernetes API's own models (the ``kubernetes`` package: every
field known, of the right type, required fields present), keeps to least privilege, and embeds
agent and daemon configurations that stalwart itself accepts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from stalwart.agent.config import load as load_agent
from stalwart.daemon.config import load_config

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
MODELS = {("v1", "Namespace"): "V1Namespace", ("v1", "Service"): "V1Service", ("v1", "ConfigMap"): "V1ConfigMap",
          ("v1", "ServiceAccount"): "V1ServiceAccount", ("apps/v1", "StatefulSet"): "V1StatefulSet",
          ("apps/v1", "Deployment"): "V1Deployment", ("apps/v1", "DaemonSet"): "V1DaemonSet",
          ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
          ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
          ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding"}
_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def check(value: Any, kind: str, path: str) -> None:
    """``value`` (parsed YAML) fits the model type ``kind`` as the client names it: no unknown
    field anywhere, every value of its declared type."""
    if value is None or kind == "object":
        return
    if m := re.fullmatch(r"(?:list|List)\[(.+)\]", kind):
        assert isinstance(value, list), f"{path}: must be a list"
        for i, item in enumerate(value):
            check(item, m.group(1), f"{path}[{i}]")
        return
    if m := re.fullmatch(r"(?:dict\((\w+), (.+)\)|Dict\[(\w+), (.+)\])", kind):
        assert isinstance(value, dict), f"{path}: must be a map"
        for key, item in value.items():
            check(item, m.group(2) or m.group(4), f"{path}.{key}")
        return
    if kind in _PRIMITIVES:
        assert isinstance(value, _PRIMITIVES[kind]) and not (kind != "bool" and isinstance(value, bool)), \
            f"{path}: must be {kind}, got {value!r}"
        return
    if kind == "datetime":
        return
    cls = getattr(k8s, kind)
    assert isinstance(value, dict), f"{path}: must be an object ({kind})"
    by_json = {j: attr for attr, j in cls.attribute_map.items()}
    for key, item in value.items():
        assert key in by_json, f"{path}: unknown field {key!r} in {kind}"
        check(item, cls.openapi_types[by_json[key]], f"{path}.{key}")


def _deserialize(value: Any, kind: str) -> Any:
    """The client's own model objects (their setters refuse a missing required field)."""
    return k8s.ApiClient()._ApiClient__deserialize(value, kind)  # type: ignore[attr-defined]


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _find(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_validates_against_the_api_models(doc: dict[str, Any]) -> None:
    kind = MODELS.get((doc["apiVersion"], doc["kind"]))
    assert kind, f"no model for {doc['apiVersion']} {doc['kind']}"
    check(doc, kind, f"{doc['kind']}/{doc['metadata']['name']}")
    obj = _deserialize(doc, kind)
    assert obj.metadata.name == doc["metadata"]["name"]
    spec = doc.get("spec", {})
    if "selector" in spec and "template" in spec:  # a workload selects its own pods
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_two_daemons_and_a_budget_for_every_workload() -> None:
    assert _find("Deployment", "stalwart-daemon")["spec"]["replicas"] == 2
    budgets = {tuple(d["spec"]["selector"]["matchLabels"].items()) for d in manifests()
               if d["kind"] == "PodDisruptionBudget"}
    for kind, name in (("Deployment", "stalwart-daemon"), ("DaemonSet", "stalwart-agent"),
                       ("StatefulSet", "stalwart-etcd")):
        labels = tuple(_find(kind, name)["spec"]["selector"]["matchLabels"].items())
        assert labels in budgets, f"{kind}/{name} has no PodDisruptionBudget"


def test_rbac_is_least_privilege() -> None:
    roles = [d for d in manifests() if d["kind"] in ("Role", "ClusterRole")]
    assert [r["metadata"]["name"] for r in roles] == ["stalwart-daemon-quarantine"]
    for rule in roles[0]["rules"]:
        assert rule["resources"] == ["nodes"] and set(rule["verbs"]) <= {"get", "patch"}, rule
    binding = _find("ClusterRoleBinding", "stalwart-daemon-quarantine")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "stalwart-daemon", "namespace": "stalwart"}]
    agent_pod = _find("DaemonSet", "stalwart-agent")["spec"]["template"]["spec"]
    assert agent_pod["automountServiceAccountToken"] is False  # the agent never talks to the API server
    for kind, name in (("Deployment", "stalwart-daemon"), ("DaemonSet", "stalwart-agent")):
        for c in _find(kind, name)["spec"]["template"]["spec"]["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]


def test_the_embedded_configurations_are_accepted_by_stalwart(tmp_path: Path) -> None:
    daemon_toml = tmp_path / "daemon.toml"
    daemon_toml.write_text(_find("ConfigMap", "stalwart-daemon")["data"]["daemon.toml"])
    config = load_config(daemon_toml)
    assert "kubectl cordon" in " ".join(config.daemon.on_quarantine)
    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text(_find("ConfigMap", "stalwart-agent")["data"]["agent.toml"])
    agent = load_agent(agent_toml, {"node_id": "gpu-node-1"})
    assert agent.node_id == "gpu-node-1" and not agent.insecure
