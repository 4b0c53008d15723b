"""The DeepSpeed integration that training scripts import.

:class:`Trainer` wraps ``deepspeed.initialize`` (the script still calls ``engine.backward`` and
``engine.step``), restores the newest good checkpoint resharded to the current data-parallel size,
hands out each global step's samples, checkpoints asynchronously, saves on SIGTERM, and reports
progress to the node's agent.
"""

from stalwart.trainer.batching import (
    DataPosition,
    GlobalBatchSampler,
    StepBatch,
    accumulation_steps,
    valid_world_sizes,
)
from stalwart.trainer.errors import (
    IncompatibleCheckpoint,
    InvalidWorldSize,
    StepOutOfOrder,
    TrainerError,
    UnsupportedConfig,
)
from stalwart.trainer.record import StepRecorder, committed_steps, read_events
from stalwart.trainer.trainer import RestoreInfo, Trainer, TrainerConfig, backend_for_device

__all__ = [
    "DataPosition",
    "GlobalBatchSampler",
    "IncompatibleCheckpoint",
    "InvalidWorldSize",
    "RestoreInfo",
    "StepBatch",
    "StepOutOfOrder",
    "StepRecorder",
    "Trainer",
    "TrainerConfig",
    "TrainerError",
    "UnsupportedConfig",
    "accumulation_steps",
    "backend_for_device",
    "committed_steps",
    "read_events",
    "valid_world_sizes",
]
