"""Budgets for a save's background work: ``background_nice`` and ``persist_bytes_per_s``."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from stalwart.ckpt import Checkpointer, SaveConfig, SingleCoordinator, load
from stalwart.ckpt import codec as codec_module

CHUNK = 64 << 10


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"a": torch.randn(4 * CHUNK // 4, generator=gen), "b": torch.arange(1000, dtype=torch.int64)}


def _round_trip(root: str, config: SaveConfig) -> None:
    state = _state()
    with Checkpointer(root, config, coordinator=SingleCoordinator()) as ckpt:
        ckpt.save(1, state).result()
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    load(root, targets, coordinator=SingleCoordinator())
    for name, tensor in state.items():
        assert torch.equal(targets[name], tensor), name


@pytest.mark.parametrize(
    "kwargs",
    [{"background_nice": -1}, {"background_nice": 20}, {"background_nice": True}, {"background_nice": 1.5},
     {"persist_bytes_per_s": 0}, {"persist_bytes_per_s": -5.0}],
)  # fmt: skip
def test_bad_budgets_are_refused(kwargs):
    with pytest.raises(ValueError):
        SaveConfig(**kwargs)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread niceness is Linux's")
@pytest.mark.parametrize("snapshot", ["blocking", "overlap"])
def test_background_nice_lowers_the_encoders_and_not_the_caller(tmp_path, monkeypatch, snapshot):
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    caller = nice()
    if caller > 19 - 5:
        pytest.skip("this process is already too nice to add 5")
    seen: list[int] = []
    encode = codec_module.encode

    def recording_encode(raw, policy):
        seen.append(nice())
        return encode(raw, policy)

    monkeypatch.setattr(codec_module, "encode", recording_encode)
    _round_trip(str(tmp_path), SaveConfig(chunk_bytes=CHUNK, background_nice=5, snapshot=snapshot))
    assert seen and set(seen) == {caller + 5}
    assert nice() == caller  # the training thread keeps its priority


def test_paced_save_keeps_to_its_rate_and_round_trips(tmp_path):
    rate = 4 * CHUNK  # bytes per second: the first chunk goes at once, each later one waits its turn
    started = time.perf_counter()
    _round_trip(str(tmp_path), SaveConfig(chunk_bytes=CHUNK, persist_bytes_per_s=rate))
    elapsed = time.perf_counter() - started
    assert elapsed >= 4 * CHUNK / rate * 0.95  # the last chunk waits for the 4 before it: never faster


def test_a_restore_with_a_read_budget_keeps_to_it_and_loads_the_same(tmp_path):
    state = _state()
    with Checkpointer(str(tmp_path), SaveConfig(chunk_bytes=CHUNK), coordinator=SingleCoordinator()) as ckpt:
        ckpt.save(1, state).result()
    size = sum(t.numel() * t.element_size() for t in state.values())
    rate = size  # one second's worth: the reads after the first wait for their turn
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    started = time.perf_counter()
    result = load(str(tmp_path), targets, coordinator=SingleCoordinator(), read_bytes_per_s=rate)
    elapsed = time.perf_counter() - started
    assert all(torch.equal(targets[k], v) for k, v in state.items())
    assert elapsed >= (result.bytes_read - CHUNK) / rate * 0.95  # never faster than the budget
    with pytest.raises(ValueError, match="read_bytes_per_s"):
        load(str(tmp_path), targets, coordinator=SingleCoordinator(), read_bytes_per_s=0)
