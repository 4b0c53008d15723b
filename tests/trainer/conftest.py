"""Fixtures for trainer tests: real DeepSpeed (CPU, gloo) under real torchrun processes."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from trainer_testlib import Direct, Torchrun, Zygote, use_zygote  # noqa: E402


@pytest.fixture(scope="session")
def ds_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for DeepSpeed children.

    DeepSpeed's CPU accelerator compiles C++ ops on first use (the shared-memory comm op at every
    ``deepspeed.initialize``, the CPU Adam op for ``offload_optimizer``), about half a minute to two
    minutes each on a small machine. ``scripts/setup.sh`` builds them into ``.venv/torch_extensions``
    (or ``$TORCH_EXTENSIONS_DIR``); without that, one directory kept in pytest's cache between
    sessions means the suite pays each compile once per machine.
    """
    built = os.path.join(os.path.dirname(os.path.dirname(HERE)), ".venv", "torch_extensions")
    cache = getattr(request.config, "cache", None)
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        ext = os.environ["TORCH_EXTENSIONS_DIR"]
    elif os.path.isdir(built):
        ext = built
    else:
        ext = str(cache.mkdir("torch_extensions") if cache is not None else tmp_path_factory.mktemp("torch_extensions"))
    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(ext),
        "OMP_NUM_THREADS": "1",
        "LOGLEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture(scope="session", autouse=True)
def zygote(ds_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """One preload process for the session: the harnesses fork their ranks from it."""
    made = Zygote(ds_env, tmp_path_factory.mktemp("zygote") / "preload.log")
    use_zygote(made)
    try:
        yield made
    finally:
        use_zygote(None)
        made.close()


@pytest.fixture(scope="module")
def torchrun_jobs(ds_env: dict[str, str]) -> Iterator[Torchrun]:
    jobs = Torchrun(ds_env)
    try:
        yield jobs
    finally:
        jobs.close()


@pytest.fixture(scope="module")
def direct_jobs(ds_env: dict[str, str]) -> Direct:
    """Like ``torchrun_jobs`` without the launcher, for tests that need a world, not torchrun."""
    return Direct(ds_env)
