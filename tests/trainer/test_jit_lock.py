"""A process killed while it builds or checks a DeepSpeed C++ op must not block the node's later
workers: torch's lock file is left behind, and without the guard every later load polls for it to
go away, forever (a chaos soak stood at step 0 so: a worker stopped by its agent mid-load)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from trainer_testlib import REPO, Torchrun, tail

pytestmark = pytest.mark.timeout(600)

# Takes the baton through torch's JIT path as a loader does, says so, then waits to be killed.
HOLDER = textwrap.dedent("""
    import sys, time
    from stalwart.trainer.jit_lock import guard_extension_builds
    from torch.utils import cpp_extension
    guard_extension_builds()
    baton = cpp_extension.FileBaton(sys.argv[1])
    assert baton.try_acquire()
    print("holding", flush=True)
    time.sleep(3600)
""")


def test_a_builder_killed_holding_the_lock_leaves_nothing_for_the_next_to_wait_on(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"holding\n"
        assert lock.exists()
        # While it lives, a second loader waits for its turn (the build is not run twice at once).
        second = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE)
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                second.communicate(timeout=1.0)
            os.kill(holder.pid, signal.SIGKILL)  # dies holding it: torch's file stays
            holder.wait()
            assert lock.exists()
            assert second.stdout is not None and second.stdout.readline() == b"holding\n"
        finally:
            second.kill()
            second.wait()
    finally:
        holder.kill()
        holder.wait()


def test_a_trainer_starts_past_a_lock_file_left_by_a_dead_builder(ds_env: dict[str, str], tmp_path: Path) -> None:
    """The built op (copied, so ninja finds it up to date) with the lock file a killed loader left:
    a training run starts, trains and says what it removed."""
    built = Path(ds_env["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    ext = tmp_path / "torch_extensions"
    if built.is_dir():
        shutil.copytree(built, ext / built.name, ignore=shutil.ignore_patterns("lock", "lock.flock"))
    else:
        (ext / built.name).mkdir(parents=True)  # not built here yet: the run compiles it first
    stale = ext / built.name / "lock"
    stale.touch()
    jobs = Torchrun({**ds_env, "TORCH_EXTENSIONS_DIR": str(ext)})
    log = tmp_path / "run.log"
    try:
        rc = jobs.run(1, str(REPO / "examples" / "train_gpt.py"), "--ckpt-dir", str(tmp_path / "ckpt"),
                      "--steps", "2", "--global-batch", "2", "--micro-batch", "2", "--dataset-len", "8",
                      "--save-every", "2", log=log, timeout=300)
    finally:
        jobs.close()
    assert rc == 0, tail(log)
    assert "left by a process that died while it built or checked a C++ extension" in log.read_text()
    assert not stale.exists()
