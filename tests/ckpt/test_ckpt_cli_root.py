"""``stalwart ckpt`` on bad roots, the verified mark after a failed verify, and the public API the
trainer uses instead of ckpt internals."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import stalwart.ckpt as ckpt
from stalwart.ckpt import Checkpointer, RetentionPolicy, SaveConfig, read_manifest
from stalwart.ckpt.format import VERIFIED_NAME, step_dir_name
from testkit import stalwart_in_process

STALWART = os.path.join(os.path.dirname(sys.executable), "stalwart")
REPO = pathlib.Path(__file__).resolve().parents[2]
ACTIONS = [["list"], ["verify"], ["inspect", "", "1"], ["gc", "", "--keep-last", "1"]]


def _subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([STALWART, "ckpt", *args], capture_output=True, text=True, timeout=120)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """The command's ``main`` in this process: the same exit status, stdout and stderr."""
    return stalwart_in_process("ckpt", *args)


def _argv(action: list[str], root: str) -> list[str]:
    return [action[0], root, *[a for a in action[1:] if a]]


def _populate(root: str) -> None:
    with Checkpointer(root, SaveConfig(chunk_bytes=4096, retention=RetentionPolicy(keep_last=9))) as c:
        for step in (1, 2):
            c.save(step, {"w": torch.randn(3000)}).result()


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: a[0])
def test_a_missing_root_is_a_usage_error(tmp_path, action):
    done = _run(*_argv(action, str(tmp_path / "nope")))
    assert done.returncode == 2
    assert "does not exist" in _one_error_line(done)


@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: a[0])
def test_a_file_as_root_is_a_usage_error(tmp_path, action):
    path = tmp_path / "file"
    path.write_text("x")
    done = _run(*_argv(action, str(path)))
    assert done.returncode == 2
    assert "not a directory" in _one_error_line(done)


@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: a[0])
def test_a_step_directory_as_root_gets_a_hint(tmp_path, action):
    root = str(tmp_path)
    _populate(root)
    step_dir = os.path.join(root, step_dir_name(2))
    done = _run(*_argv(action, step_dir))
    assert done.returncode == 2
    line = _one_error_line(done)
    assert "step directory" in line and "hint" in line and f"{root} 2" in line
    assert sorted(os.listdir(root)) == [step_dir_name(1), step_dir_name(2)]  # gc removed nothing


def test_not_found_is_exit_3_with_one_line(tmp_path):
    root = str(tmp_path)
    # the installed command once: nothing else (an import's warning, a traceback) reaches stderr,
    # and its main in this process says the same
    real = _subprocess("list", root)
    assert real.returncode == 3
    _one_error_line(real)
    in_process = _run("list", root)
    assert (in_process.returncode, in_process.stdout, in_process.stderr) == (3, real.stdout, real.stderr)
    for args in (["verify", root], ["inspect", root, "5"], ["verify", root, "5"]):
        done = _run(*args)
        assert done.returncode == 3, args
        _one_error_line(done)


def test_a_failed_verify_clears_the_verified_mark(tmp_path):
    root = str(tmp_path)
    _populate(root)
    assert _run("verify", root, "2").returncode == 0
    rows = json.loads(_run("list", root, "--json").stdout)
    assert [r["verified"] for r in rows] == [False, True]
    manifest = read_manifest(root, 2)
    chunk = manifest.tensors["w"].parts[0].chunks[0]
    path = os.path.join(root, step_dir_name(2), "rank-00000.bin")
    with open(path, "r+b") as f:
        f.seek(chunk.offset + 10)
        byte = f.read(1)[0]
        f.seek(chunk.offset + 10)
        f.write(bytes([byte ^ 4]))
    done = _run("verify", root, "2")
    assert done.returncode == 1 and "checksum" in done.stdout
    assert not os.path.exists(os.path.join(root, step_dir_name(2), VERIFIED_NAME))
    rows = json.loads(_run("list", root, "--json").stdout)
    assert [r["verified"] for r in rows] == [False, False]


def test_the_public_api_covers_what_the_trainer_needs(tmp_path):
    assert ckpt.set_aside is ckpt.storage.set_aside and ckpt.atomic_write is ckpt.storage.atomic_write
    root = str(tmp_path)
    with Checkpointer(root, SaveConfig(retention=None)) as c:
        assert c.inflight() is None
        handle = c.save(1, {"w": torch.zeros(10)})
        assert c.inflight() in (handle, None)  # None once it is done
        handle.result()
        assert c.inflight() is None
    ckpt.atomic_write(root, "note.json", b"{}")
    assert ckpt.set_aside(root, 1) is not None and not os.path.exists(os.path.join(root, step_dir_name(1)))


def test_the_trainer_uses_no_ckpt_internals():
    offenders = []
    for path in sorted((REPO / "trainer").glob("*.py")):
        text = path.read_text()
        for needle in ("stalwart.ckpt.storage", "stalwart.ckpt.saver", "._inflight", "ckpt.storage."):
            if needle in text:
                offenders.append(f"{path.name}: {needle}")
    assert offenders == []
