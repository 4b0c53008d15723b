"""Real torchrun processes on loopback, each standing for one node, with --rdzv-backend stalwart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stalwart.coord.local import LocalEtcd, free_port
from testkit import kill_tree, torchrun, wait_exit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "elastic_gloo.py")


def _read(log: Path) -> list[dict[str, float]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _wait_for(log: Path, what: str, pred: Callable[[list[dict[str, float]]], bool], timeout: float,
              logs_dir: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred(_read(log)):
            return
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                      for p in sorted(logs_dir.glob("node*.out")))
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


@pytest.fixture
def nodes() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        yield procs
    finally:
        for p in procs.values():
            kill_tree(p.pid)
            p.wait()


def _worlds_after(rows: list[dict[str, float]], t: float, nodes: set[str]) -> dict[str, set[int]]:
    seen: dict[str, set[int]] = {n: set() for n in nodes}
    for r in rows:
        if r["t"] > t and r["node"] in nodes:
            seen[str(r["node"])].add(int(r["world"]))
    return seen


def test_node_killed_world_shrinks_then_regrows_when_it_returns(etcd_server: LocalEtcd, tmp_path: Path,
                                             nodes: dict[str, subprocess.Popen[bytes]]) -> None:
    log = tmp_path / "steps.jsonl"
    job = f"shrink-{os.getpid()}"

    def start(name: str) -> None:
        nodes[name] = torchrun(SCRIPT, "--steps", "100000", "--step-time", "0.05", "--steps-log", str(log),
                               nnodes="2:3", endpoint=etcd_server.endpoints[0], job=job, node=name,
                               conf="join_timeout=120", log_file=str(tmp_path / f"{name}.out"))

    for name in ("node0", "node1", "node2"):
        start(name)
    _wait_for(log, "all three nodes training at world size 3",
              lambda rows: {r["node"] for r in rows if r["world"] == 3} == {"node0", "node1", "node2"},
              120, tmp_path)

    kill_tree(nodes["node2"].pid)  # the node dies: its torchrun and its workers
    nodes["node2"].wait()
    killed = time.time()
    survivors = {"node0", "node1"}
    _wait_for(log, "survivors training at world size 2",
              lambda rows: all(2 in w for w in _worlds_after(rows, killed, survivors).values()), 90, tmp_path)
    for name in survivors:
        assert nodes[name].poll() is None, f"{name}'s torchrun exited"

    start("node2")
    returned = time.time()
    _wait_for(log, "the world back at size 3",
              lambda rows: all(3 in w for w in _worlds_after(rows, returned, survivors | {"node2"}).values()),
              120, tmp_path)
    rows = [r for r in _read(log) if r["t"] > returned and r["world"] == 3]
    assert sorted({int(r["rank"]) for r in rows}) == [0, 1, 2]


def test_unreachable_etcd_fails_clearly_within_the_join_timeout(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    out = tmp_path / "node.out"
    start = time.monotonic()
    proc = torchrun(SCRIPT, "--steps", "1", nnodes="1:2", endpoint=endpoint, job="unreachable", node="n0",
                    conf="join_timeout=20,etcd_timeout=3", log_file=str(out))
    rc = wait_exit(proc, 60)
    took = time.monotonic() - start
    text = out.read_text(errors="replace")
    assert rc != 0
    assert "RendezvousConnectionError" in text and endpoint in text, text[-3000:]
    assert took < 20 + 10, f"took {took:.1f} s"


def test_backend_is_registered_for_torchrun() -> None:
    code = ("from torch.distributed.elastic.rendezvous import registry, rendezvous_handler_registry as r; "
            "print('stalwart' in r._registry)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
