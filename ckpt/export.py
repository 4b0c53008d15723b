"""Export one checkpoint as a single consolidated state dict: a safetensors or a torch ``.pt`` file.

A checkpoint holds each tensor as the parts its saving ranks owned; export reads every selected
tensor whole (the loader tiles the parts of any saving world size and verifies every chunk's
checksum on the way), writes the file under a temporary name, fsyncs it, renames it into place,
and then reads it back and compares every tensor bit for bit with what was loaded. A file that
does not read back identical is removed and :class:`ExportFailed` raised.

Which tensors and under which names is the caller's choice (``rename``): this package knows
nothing of models. safetensors is an optional dependency (``stalwart[export]``); ``pt`` needs
only torch (load it with ``torch.load(path, weights_only=True)``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stalwart.ckpt.coord import SingleCoordinator
from stalwart.ckpt.errors import CheckpointError
from stalwart.ckpt.loader import load
from stalwart.ckpt.storage import fsync_dir, read_manifest

FORMATS = ("safetensors", "pt")


class ExportFailed(CheckpointError):
    """No tensor was selected, two tensors got the same name, or the written file did not read
    back bitwise equal to the checkpoint (it is removed)."""


@dataclass(frozen=True)
class ExportReport:
    """What was written: ``tensors`` tensors, ``bytes`` bytes of tensor data, verified on load."""

    step: int
    world_size: int
    path: str
    format: str
    tensors: int
    bytes: int


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def _write(state: dict[str, torch.Tensor], path: str, fmt: str, metadata: dict[str, str]) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, path, metadata=metadata)
    else:
        with open(path, "wb") as f:
            torch.save(state, f)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _read(path: str, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "safetensors":
        from safetensors.torch import load_file

        return dict(load_file(path, device="cpu"))
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise ExportFailed(f"{path} does not read back as a state dict")
    return loaded


def export(root: str, step: int, path: str, fmt: str, *, rename: Callable[[str], str | None] | None = None,
           dtype: torch.dtype | None = None) -> ExportReport:
    """Write checkpoint ``step`` under ``root`` to ``path`` as one state dict in ``fmt``.

    ``rename(name)`` gives a checkpoint tensor's name in the output, or ``None`` to leave it out
    (default: every tensor, as named). ``dtype`` casts floating-point tensors (default: as saved).
    An existing ``path`` is replaced only once the new file is complete. Raises
    :class:`~stalwart.ckpt.CheckpointNotFound`, :class:`~stalwart.ckpt.CheckpointCorrupt` (a
    chunk fails its checksum), :class:`ExportFailed`, ``ValueError`` for an unknown format, and
    ``ImportError`` when safetensors is not installed.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "safetensors":
        import safetensors.torch  # noqa: F401 - fail before reading anything
    manifest = read_manifest(root, step)
    chosen: dict[str, str] = {}  # output name -> checkpoint name
    for name in sorted(manifest.tensors):
        out = rename(name) if rename is not None else name
        if out is None:
            continue
        if out in chosen:
            raise ExportFailed(f"tensors {chosen[out]!r} and {name!r} would both be exported as {out!r}")
        chosen[out] = name
    if not chosen:
        raise ExportFailed(f"step {step} under {root}: no tensor selected for export")
    targets = {name: torch.empty(manifest.tensors[name].shape, dtype=manifest.tensors[name].torch_dtype)
               for name in chosen.values()}  # fmt: skip
    load(root, targets, step=step, coordinator=SingleCoordinator())
    state: dict[str, torch.Tensor] = {}
    for out, name in chosen.items():
        t = targets[name]
        state[out] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    meta = {"step": str(step), "world_size": str(manifest.world_size), "manifest_digest": manifest.digest}
    try:
        _write(state, tmp, fmt, meta)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
    back = _read(path, fmt)
    bad = sorted(set(state) ^ set(back)) or [k for k in state if not _same_bits(state[k], back[k])]
    if bad:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise ExportFailed(f"{path} did not read back equal to step {step} (first difference: {bad[0]!r}); removed")
    size = sum(t.numel() * t.element_size() for t in state.values())
    return ExportReport(step, manifest.world_size, path, fmt, len(state), size)
