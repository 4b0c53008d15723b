"""The DeepSpeed integration that training scripts import.

:class:`Trainer` wraps ``deepspeed.initialize`` (the script still calls ``engine.backward`` and
``engine.step``), restores the newest good checkpoint resharded to the current data-parallel size,
hands out each global step's samples, checkpoints asynchronously, saves on SIGTERM, and reports
progress to the node's agent. Health checks roll a diverging step back to the restore point
before it (a memory generation or the checkpoint; ``health.py``); a job that keeps diverging
raises :class:`TrainingDiverged`, and scripts then exit with :data:`EXIT_DIVERGED`.
"""

import importlib
from typing import Any

from stalwart.proto.contract import EXIT_DIVERGED as EXIT_DIVERGED

# EXIT_DIVERGED: exit status of a training script stopped by :class:`TrainingDiverged` (a crash
# is 1, a SIGTERM with its final checkpoint 0): restarting the same job will not help. Defined in
# the agent-trainer contract, since the agent reads it.

# Names are imported on first use: ``stalwart.trainer.agent_client`` (used by any training
# process, DeepSpeed or not) must not pay for importing DeepSpeed through this package.
_EXPORTS = {
    "DataPosition": "batching",
    "DataWindow": "batching",
    "GlobalBatchSampler": "batching",
    "StepBatch": "batching",
    "accumulation_steps": "batching",
    "valid_world_sizes": "batching",
    "DataOrderError": "data",
    "StepBatchSampler": "data",
    "IncompatibleCheckpoint": "errors",
    "InvalidWorldSize": "errors",
    "StepOutOfOrder": "errors",
    "TrainerError": "errors",
    "TrainingDiverged": "errors",
    "guard_extension_builds": "jit_lock",
    "Fault": "health",
    "HealthConfig": "health",
    "HealthMonitor": "health",
    "Rollback": "health",
    "RollbackLedger": "health",
    "UnsupportedConfig": "errors",
    "StepRecorder": "record",
    "committed_steps": "record",
    "read_events": "record",
    "skipped_samples": "record",
    "PeerConfig": "peer",
    "ReformFailed": "errors",
    "ReformSpec": "reform",
    "ReformTimings": "config",
    "RestoreInfo": "config",
    "Trainer": "trainer",
    "TrainerConfig": "config",
    "backend_for_device": "engine",
}
__all__ = sorted([*_EXPORTS, "EXIT_DIVERGED"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stalwart.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"stalwart.trainer.{module}"), name)
    globals()[name] = value
    return value
