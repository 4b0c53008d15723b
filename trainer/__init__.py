"""The DeepSpeed integration that training scripts import.

:class:`Trainer` wraps ``deepspeed.initialize`` (the script still calls ``engine.backward`` and
``engine.step``), restores the newest good checkpoint resharded to the current data-parallel size,
hands out each global step's samples, checkpoints asynchronously, saves on SIGTERM, and reports
progress to the node's agent.
"""

import importlib
from typing import Any

# Names are imported on first use: ``stalwart.trainer.agent_client`` (used by any training
# process, DeepSpeed or not) must not pay for importing DeepSpeed through this package.
_EXPORTS = {
    "DataPosition": "batching",
    "GlobalBatchSampler": "batching",
    "StepBatch": "batching",
    "accumulation_steps": "batching",
    "valid_world_sizes": "batching",
    "IncompatibleCheckpoint": "errors",
    "InvalidWorldSize": "errors",
    "StepOutOfOrder": "errors",
    "TrainerError": "errors",
    "UnsupportedConfig": "errors",
    "StepRecorder": "record",
    "committed_steps": "record",
    "read_events": "record",
    "RestoreInfo": "trainer",
    "Trainer": "trainer",
    "TrainerConfig": "trainer",
    "backend_for_device": "trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stalwart.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"stalwart.trainer.{module}"), name)
    globals()[name] = value
    return value
