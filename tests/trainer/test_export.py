"""``stalwart ckpt export``: checkpoints of real DeepSpeed runs at two world sizes and ZeRO stages
become one state dict that loads into a fresh model with weights bitwise equal to the trained
ones; a corrupt chunk fails the export and leaves no file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_testlib import Direct, tail
from zero_child import Net

from stalwart.ckpt import read_manifest
from stalwart.cli.main import main as stalwart

CHILD = str(Path(__file__).with_name("export_child.py"))
RUNS = {1: "z2", 2: "z3"}  # world size -> ZeRO config trained at it
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def trained(direct_jobs: Direct, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    outs = {}
    for world, name in RUNS.items():
        out = tmp_path_factory.mktemp(f"export-w{world}")
        log = out / "run.log"
        assert direct_jobs.run(world, CHILD, str(out), name, log=log) == 0, tail(log)
        outs[world] = out
    return outs


def _fresh_model(path: Path, fmt: str) -> Net:
    if fmt == "safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, weights_only=True)
    torch.manual_seed(99)  # other initial weights than the trained model's
    model = Net()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("world", sorted(RUNS))
def test_export_loads_into_a_fresh_model_bitwise_equal(trained: dict[int, Path], world: int, fmt: str,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = RUNS[world]
    out = tmp_path / f"model.{fmt}"
    rc = stalwart(["ckpt", "export", str(trained[world] / "ckpt" / name), "4", "--to", fmt, "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert f"saved by {world} ranks" in capsys.readouterr().out
    model = _fresh_model(out, fmt)
    ref = np.load(trained[world] / f"ref-{name}-4.npz")
    params = dict(model.named_parameters())
    assert {f"fp32/{n}" for n in params} == {k for k in ref.files if k.startswith("fp32/")}
    for n, p in params.items():
        assert p.detach().numpy().tobytes() == ref[f"fp32/{n}"].tobytes(), n


def test_an_existing_output_is_refused_and_force_replaces_it(trained: dict[int, Path], tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"old")
    root = str(trained[1] / "ckpt" / RUNS[1])
    assert stalwart(["ckpt", "export", root, "2", "--out", str(out)]) == 2
    assert out.read_bytes() == b"old"
    assert stalwart(["ckpt", "export", root, "2", "--out", str(out), "--force", "--dtype", "bfloat16"]) == 0
    from safetensors.torch import load_file

    state = load_file(str(out))
    assert state and all(t.dtype == torch.bfloat16 for t in state.values())
    assert stalwart(["ckpt", "export", root, "3", "--out", str(tmp_path / "none.pt"), "--to", "pt"]) == 3


def test_a_corrupt_chunk_fails_the_export_and_leaves_no_file(trained: dict[int, Path], tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(trained[2] / "ckpt" / RUNS[2], root)
    part = read_manifest(str(root), 4).tensors["fp32/fc1.weight"].parts[-1]  # a model weight, not a moment
    shard = root / "step-000000000004" / part.file
    data = bytearray(shard.read_bytes())
    data[part.chunks[0].offset] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = tmp_path / "model.safetensors"
    assert stalwart(["ckpt", "export", str(root), "4", "--out", str(out)]) == 1
    assert not out.exists() and not list(tmp_path.glob(".model.safetensors.tmp-*"))
