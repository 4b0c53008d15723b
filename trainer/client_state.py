"""User state saved and restored with the trainer's checkpoints (an EMA of the weights, a data
mixer's weights, a curriculum's counters).

Register each piece under a name with :meth:`stalwart.trainer.Trainer.register_state`: an object
with ``state_dict()`` / ``load_state_dict(state)``, or a pair of callables ``save() -> state`` and
``load(state)``. A state is a nest of dicts (string or integer keys), lists, tuples (restored as
lists), tensors and JSON scalars. Tensors become checkpoint tensors (``client/<name>/<i>``, raw
bytes with checksums, read back on the CPU); the rest is JSON in the checkpoint's metadata: no
pickle, as for everything else in a checkpoint.

The state is taken to be the same on every rank (replicated): one copy is saved, and every rank
loads it. Each save takes the state at the step it saves (tensors are copied before ``save``
returns); each restore (start, re-form, rollback) hands every registered piece the state of the
checkpoint restored. A piece registered after the trainer restored gets that state at once, so
registering after :meth:`~stalwart.trainer.Trainer.initialize` works. A checkpoint without a
piece's state (saved before it was registered) leaves that piece as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.ckpt import Coordinator, load, read_manifest
from stalwart.trainer.errors import UnsupportedConfig

PREFIX = "client/"
_TENSOR, _DICT = "$tensor", "$dict"


@dataclass(frozen=True)
class _Piece:
    save: Callable[[], Any]
    load: Callable[[Any], None]


def _flatten(value: Any, name: str, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"{PREFIX}{name}/{len(tensors)}"
        tensors[key] = value.detach().contiguous()
        return {_TENSOR: key}
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise UnsupportedConfig(f"client state {path}: key {k!r} is not a string or an integer")
            items.append([k, _flatten(v, name, tensors, f"{path}.{k}")])
        return {_DICT: items}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, name, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise UnsupportedConfig(f"client state {path}: a {type(value).__name__} cannot be saved without pickle")


def _unflatten(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, dict) and set(value) == {_TENSOR}:
        return tensors[value[_TENSOR]]
    if isinstance(value, dict) and set(value) == {_DICT}:
        return {k: _unflatten(v, tensors) for k, v in value[_DICT]}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value


class ClientStates:
    """The registered pieces, and the state of the last checkpoint restored. Not thread-safe:
    register and save from the training thread."""

    def __init__(self) -> None:
        self._pieces: dict[str, _Piece] = {}
        self._restored: dict[str, Any] = {}  # name -> state of the checkpoint last restored

    def register(self, name: str, obj: Any = None, *, save: Callable[[], Any] | None = None,
                 load: Callable[[Any], None] | None = None) -> None:
        """Add a piece (see the module docstring); raises ``ValueError`` for a bad name or mix."""
        if not name or "/" in name or name in self._pieces:
            raise ValueError(f"client state name must be new, non-empty and without '/', got {name!r}")
        if obj is not None and (save is not None or load is not None):
            raise ValueError("pass an object with state_dict/load_state_dict, or save= and load=, not both")
        if obj is not None:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ValueError(f"{type(obj).__name__} has no state_dict()/load_state_dict(); pass save= and load=")
            piece = _Piece(obj.state_dict, obj.load_state_dict)
        elif save is not None and load is not None:
            piece = _Piece(save, load)
        else:
            raise ValueError("client state needs an object with state_dict/load_state_dict, or both save= and load=")
        self._pieces[name] = piece
        if name in self._restored:
            piece.load(self._restored[name])

    @property
    def registered(self) -> bool:
        return bool(self._pieces)

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every piece's state now: (checkpoint tensors, JSON metadata)."""
        tensors: dict[str, torch.Tensor] = {}
        meta = {name: _flatten(piece.save(), name, tensors, name) for name, piece in self._pieces.items()}
        return tensors, meta

    def restore(self, root: str, step: int, meta: Mapping[str, Any] | None, coordinator: Coordinator,
                timeout_s: float) -> None:
        """Read checkpoint ``step``'s client state (collective: every rank, same arguments) and
        hand it to the registered pieces. ``meta``: the saving rank 0's ``client`` metadata."""
        self._restored = {}
        if not meta:
            return
        manifest = read_manifest(root, step)
        targets = {name: torch.empty(rec.shape, dtype=rec.torch_dtype)
                   for name, rec in manifest.tensors.items() if name.startswith(PREFIX)}  # fmt: skip
        if targets:
            load(root, targets, step=step, coordinator=coordinator, timeout_s=timeout_s)
        self._restored = {name: _unflatten(value, targets) for name, value in meta.items()}
        for name, piece in self._pieces.items():
            if name in self._restored:
                piece.load(self._restored[name])
