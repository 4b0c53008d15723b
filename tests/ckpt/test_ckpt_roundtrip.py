"""Save at one world size, load at another, ranks simulated as threads of this process."""

from __future__ import annotations

import pytest
import torch
from ckpt_testlib import SPECS, Spec, check_targets, rank_state, rank_targets, run_ranks

from stalwart.ckpt import (
    Checkpointer,
    CodecPolicy,
    LayoutMismatch,
    RetentionPolicy,
    SaveConfig,
    Shard,
    load,
    read_manifest,
)

SMALL = SaveConfig(chunk_bytes=4096, encode_threads=2)

SAVE_SCHEMES = {"w32": "rows", "bf": "flat", "h16": "cols", "ids": "flat", "f64": "rows", "bias": "replicated"}
LOAD_SCHEMES = {"w32": "flat", "bf": "flat", "h16": "rows", "ids": "cols", "f64": "cols", "bias": "flat"}


def save_world(root, world, step, config=SMALL, specs=SPECS, schemes=SAVE_SCHEMES, metadata=True):
    def rank(r, coord):
        with Checkpointer(root, config, coordinator=coord) as ckpt:
            meta = {"rank": r, "rng": bytes([r, 255, 0])} if metadata else None
            return ckpt.save(step, rank_state(specs, schemes, step, world, r), meta).result()

    return run_ranks(world, rank)


def load_world(root, world, specs=SPECS, schemes=LOAD_SCHEMES, step=None):
    def rank(r, coord):
        targets = rank_targets(specs, schemes, world, r)
        result = load(root, targets, coordinator=coord, step=step)
        return result, check_targets(specs, targets, result.step)

    return run_ranks(world, rank)


@pytest.mark.parametrize("saved, loaded", [(1, 1), (2, 3), (4, 2), (3, 1), (5, 7)])
def test_roundtrip_between_world_sizes(tmp_path, saved, loaded):
    infos = save_world(str(tmp_path), saved, step=5)
    assert {i.manifest_digest for i in infos} == {infos[0].manifest_digest}
    assert read_manifest(str(tmp_path), 5).world_size == saved
    for result, bad in load_world(str(tmp_path), loaded):
        assert result.step == 5 and bad == []
        assert [m["rank"] for m in result.metadata] == list(range(saved))
        assert result.metadata[saved - 1]["rng"] == bytes([saved - 1, 255, 0])


@pytest.mark.parametrize("mode", ["auto", "zstd", "none"])
def test_roundtrip_every_compression_mode(tmp_path, mode):
    config = SaveConfig(chunk_bytes=4096, compression=CodecPolicy(mode=mode, level=3))
    save_world(str(tmp_path), 2, step=1, config=config)
    for _, bad in load_world(str(tmp_path), 3):
        assert bad == []


def test_compressible_data_is_compressed_and_random_data_is_not(tmp_path):
    state = {"zeros": torch.zeros(100_000), "noise": torch.randn(100_000)}
    with Checkpointer(str(tmp_path), SaveConfig(chunk_bytes=1 << 16)) as ckpt:
        ckpt.save(1, state).result()
    manifest = read_manifest(str(tmp_path), 1)
    codecs = {name: {c.codec for p in t.parts for c in p.chunks} for name, t in manifest.tensors.items()}
    assert codecs == {"zeros": {"zstd"}, "noise": {"raw"}}


def test_replicated_tensor_is_written_by_one_rank(tmp_path):
    save_world(str(tmp_path), 4, step=2)
    manifest = read_manifest(str(tmp_path), 2)
    assert len(manifest.tensors["bias"].parts) == 1
    assert len(manifest.tensors["w32"].parts) == 4


def test_overlap_snapshot_is_consistent_after_wait_snapshot(tmp_path):
    spec = Spec("big", (256, 1024), torch.float32)
    state = rank_state([spec], {}, 3, 1, 0)
    with Checkpointer(str(tmp_path), SaveConfig(snapshot="overlap")) as ckpt:
        handle = ckpt.save(3, state)
        assert handle.wait_snapshot(30)
        state["big"].tensor.fill_(0)  # the training step may now change the tensor
        handle.result()
    targets = rank_targets([spec], {}, 1, 0)
    load(str(tmp_path), targets)
    assert check_targets([spec], targets, 3) == []


def test_noncontiguous_and_reshaped_inputs(tmp_path):
    base = torch.randn(8, 6)
    state = {"t": base.t(), "flat": Shard.flat(base[:, :3].reshape(4, 6), (24,), 0)}
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).result()
    out_t = torch.empty(8, 6).t()  # a non-contiguous destination
    out_flat = torch.empty(24)
    load(str(tmp_path), {"t": out_t, "flat": Shard.flat(out_flat, (24,), 0)})
    assert torch.equal(out_t, base.t())
    assert torch.equal(out_flat, base[:, :3].reshape(-1))


def test_later_steps_win_and_explicit_step_loads_older(tmp_path):
    root = str(tmp_path)
    config = SaveConfig(chunk_bytes=4096, retention=RetentionPolicy(keep_last=5))
    for step in (10, 20, 30):
        save_world(root, 2, step=step, config=config)
    (result, bad), = load_world(root, 1)
    assert result.step == 30 and bad == []
    (result, bad), = load_world(root, 1, step=20)
    assert result.step == 20 and bad == []


@pytest.mark.parametrize(
    "targets",
    [
        {"missing": torch.zeros(3)},
        {"bias": torch.zeros(13, dtype=torch.float64)},
        {"bias": torch.zeros(14)},
    ],
)
def test_requests_that_do_not_fit_raise_layout_mismatch(tmp_path, targets):
    save_world(str(tmp_path), 1, step=1)
    with pytest.raises(LayoutMismatch):
        load(str(tmp_path), targets)


def test_load_with_a_world_where_one_rank_asks_for_a_missing_tensor(tmp_path):
    save_world(str(tmp_path), 2, step=1)

    def rank(r, coord):
        targets = {"bias": torch.zeros(13)} if r == 0 else {"nope": torch.zeros(1)}
        load(str(tmp_path), targets, coordinator=coord)

    with pytest.raises(LayoutMismatch):
        run_ranks(2, rank)
