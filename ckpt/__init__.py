"""Sharded async checkpoints: short snapshot, background persist, verified load at any world size.

Save with :class:`Checkpointer` (one per rank), load with :func:`load`; both take a
:class:`Coordinator` for multi-rank worlds (torch.distributed by default when initialized). The
on-disk format is described in ``FORMAT.md`` next to this file.
"""

from stalwart.ckpt.codec import CodecPolicy
from stalwart.ckpt.coord import (
    CallbackCoordinator,
    Coordinator,
    SingleCoordinator,
    TorchDistCoordinator,
    default_coordinator,
)
from stalwart.ckpt.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    CommitFailed,
    CommitFenced,
    CommitTimeout,
    LayoutMismatch,
    SaveInProgress,
    UnsafePath,
    UnsupportedFormat,
)
from stalwart.ckpt.export import FORMATS as EXPORT_FORMATS
from stalwart.ckpt.export import ExportFailed, ExportReport, export
from stalwart.ckpt.format import decode_metadata, encode_metadata
from stalwart.ckpt.layout import Box, Region, split_evenly
from stalwart.ckpt.loader import LoadResult, load
from stalwart.ckpt.retention import GcReport, RetentionPolicy, collect_garbage
from stalwart.ckpt.saver import Checkpointer, CommitInfo, CommittedSnapshot, SaveConfig, SaveHandle
from stalwart.ckpt.shard import Shard, host_copy
from stalwart.ckpt.storage import CheckpointInfo, atomic_write, list_checkpoints, read_manifest, set_aside
from stalwart.ckpt.verify import VerifyReport, inspect, verify

__all__ = [
    "Box",
    "CallbackCoordinator",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointExists",
    "CheckpointInfo",
    "CheckpointNotFound",
    "Checkpointer",
    "CodecPolicy",
    "CommitFailed",
    "CommitFenced",
    "CommitInfo",
    "CommittedSnapshot",
    "CommitTimeout",
    "EXPORT_FORMATS",
    "ExportFailed",
    "ExportReport",
    "Coordinator",
    "GcReport",
    "LayoutMismatch",
    "LoadResult",
    "Region",
    "RetentionPolicy",
    "SaveConfig",
    "SaveHandle",
    "SaveInProgress",
    "Shard",
    "SingleCoordinator",
    "TorchDistCoordinator",
    "UnsafePath",
    "UnsupportedFormat",
    "VerifyReport",
    "atomic_write",
    "collect_garbage",
    "default_coordinator",
    "decode_metadata",
    "encode_metadata",
    "export",
    "host_copy",
    "inspect",
    "list_checkpoints",
    "load",
    "read_manifest",
    "set_aside",
    "split_evenly",
    "verify",
]
