"""``stalwart ckpt``: the real command once, then its ``main`` in this process (same exit status,
stdout and stderr, without an interpreter that imports torch for each call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from stalwart.ckpt import Checkpointer, RetentionPolicy, SaveConfig
from stalwart.ckpt.format import step_dir_name
from testkit import stalwart_in_process

STALWART = os.path.join(os.path.dirname(sys.executable), "stalwart")


def _subprocess(*args):
    return subprocess.run([STALWART, "ckpt", *args], capture_output=True, text=True, timeout=120)


def _run(*args):
    return stalwart_in_process("ckpt", *args)


def _populate(root):
    config = SaveConfig(chunk_bytes=4096, retention=RetentionPolicy(keep_last=10))
    with Checkpointer(root, config) as ckpt:
        for step in (100, 200, 300):
            ckpt.save(step, {"w": torch.randn(64, 100), "zeros": torch.zeros(5000)}, {"step": step}).result()
    os.makedirs(os.path.join(root, step_dir_name(400)))  # a crashed save: no manifest
    with open(os.path.join(root, step_dir_name(400), "rank-00000.bin"), "wb") as f:
        f.write(b"partial")


def test_list_verify_inspect_gc(tmp_path):
    root = str(tmp_path)
    _populate(root)

    listed = _subprocess("list", root, "--json")  # the installed command, end to end
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["step"], r["state"], r["verified"]) for r in rows] == [
        (100, "committed", False), (200, "committed", False), (300, "committed", False), (400, "unfinished", False)
    ]

    verified = _run("verify", root, "--progress", "always")
    assert verified.returncode == 0, verified.stdout
    assert verified.stdout.count(": OK") == 3
    assert "verify step 300" in verified.stderr  # progress lines
    assert [r["verified"] for r in json.loads(_run("list", root, "--json").stdout)] == [True, True, True, False]

    text = _run("list", root)
    assert text.returncode == 0 and "unfinished" in text.stdout

    inspected = _run("inspect", root, "200", "--json")
    assert inspected.returncode == 0
    summary = json.loads(inspected.stdout)
    assert summary["step"] == 200 and summary["world_size"] == 1
    assert {t["name"]: t["shape"] for t in summary["tensors"]} == {"w": [64, 100], "zeros": [5000]}
    assert summary["compression_ratio"] > 1.0  # the zeros compress
    human = _run("inspect", root, "200")
    assert human.returncode == 0 and "zeros" in human.stdout and "ratio" in human.stdout

    dry = _run("gc", root, "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0
    assert sorted(os.listdir(root)) == [step_dir_name(s) for s in (100, 200, 300, 400)]

    gc = _run("gc", root, "--keep-last", "1", "--grace-s", "0")
    assert gc.returncode == 0
    # 300 is the newest and the newest verified; 400 never committed.
    assert sorted(os.listdir(root)) == [step_dir_name(300)]


def test_missing_things_exit_3(tmp_path):
    root = str(tmp_path)
    assert _run("verify", root).returncode == 3
    assert _run("inspect", root, "5").returncode == 3


def test_bad_arguments_exit_2(tmp_path):
    assert _run("gc", str(tmp_path), "--keep-last", "0").returncode == 2
    assert _run("inspect", str(tmp_path)).returncode == 2
