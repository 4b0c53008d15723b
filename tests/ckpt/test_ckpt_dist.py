"""Round trips between real processes coordinated by torch.distributed (gloo on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_dist_child.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(mode: str, root: str, world: int, step: int) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, CHILD, mode, root, str(step), str(port)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
        )
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=180)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


@pytest.mark.parametrize("saved, loaded", [(1, 1), (2, 3), (4, 2), (3, 1)])
def test_multiprocess_roundtrip(tmp_path, saved, loaded):
    root = str(tmp_path)
    saves = _world("save", root, saved, 7)
    assert len({s["digest"] for s in saves}) == 1
    for out in _world("load", root, loaded, 0):
        assert out["step"] == 7 and out["saved_world"] == saved
        assert out["bad"] == []
        assert out["meta_ranks"] == list(range(saved))
