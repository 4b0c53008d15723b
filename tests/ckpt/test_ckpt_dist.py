"""Round trips between real processes coordinated by torch.distributed (gloo on 127.0.0.1).

One pool of processes forms every world in turn (a process group each): the saves, then the
loads, each load in processes that did not save that checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_dist_child.py")
CASES = [(1, 1), (2, 3), (4, 2), (3, 1)]  # (world that saves, world that loads)
POOL = max(saved + loaded for saved, loaded in CASES)  # loaders after the savers: never the same process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], tuple[list[dict], list[dict]]]:
    """For each case, what the ranks of its save and of its load reported."""
    base = tmp_path_factory.mktemp("dist")
    roots = [str(base / f"s{saved}-l{loaded}") for saved, loaded in CASES]
    plan = [{"mode": "save", "root": root, "step": 7, "members": list(range(saved))}
            for root, (saved, _) in zip(roots, CASES, strict=True)]
    plan.append({"mode": "barrier", "root": "", "step": 0, "members": list(range(POOL))})  # every save is done
    plan += [{"mode": "load", "root": root, "step": 0, "members": list(range(saved, saved + loaded))}
             for root, (saved, loaded) in zip(roots, CASES, strict=True)]
    for task in plan:
        task["port"] = _free_port()
    procs = [subprocess.Popen([sys.executable, CHILD, json.dumps(plan), str(index)],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for index in range(POOL)]
    outs: dict[int, list[dict]] = {}
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-3000:]
            for line in stdout.splitlines():
                if line.startswith("RESULT "):
                    out = json.loads(line[len("RESULT "):])
                    outs.setdefault(out.pop("task"), []).append(out)
    finally:
        for p in procs:  # one failed: the others would wait for it in their next world
            if p.poll() is None:
                p.kill()
                p.wait()
    first_load = len(CASES) + 1  # after the saves and the barrier
    return {case: (outs.get(i, []), outs.get(first_load + i, [])) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("saved, loaded", CASES)
def test_multiprocess_roundtrip(worlds, saved, loaded):
    saves, loads = worlds[(saved, loaded)]
    assert sorted(s["rank"] for s in saves) == list(range(saved))
    assert len({s["digest"] for s in saves}) == 1
    assert sorted(out["rank"] for out in loads) == list(range(loaded))
    assert not {s["pid"] for s in saves} & {out["pid"] for out in loads}  # a fresh process loads
    for out in loads:
        assert out["step"] == 7 and out["saved_world"] == saved
        assert out["bad"] == []
        assert out["meta_ranks"] == list(range(saved))
