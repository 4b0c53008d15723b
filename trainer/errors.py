"""The exceptions of ``stalwart.trainer``: one type per failure a caller (or operator) can act on.

Everything raised on purpose derives from :class:`TrainerError`. Errors of the checkpoint layer
(``stalwart.ckpt``) are passed through unchanged, except a layout mismatch at restore, which
becomes :class:`IncompatibleCheckpoint` naming the first tensor that does not fit.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base of every error raised by ``stalwart.trainer``."""


class InvalidWorldSize(TrainerError):
    """The global batch cannot be split evenly over this many data-parallel ranks.

    Raised at start, before any step, so the round fails fast. ``valid_sizes`` lists the world
    sizes that would work; operators avoid the error with the daemon's ``node_quantum``.
    """

    def __init__(self, world_size: int, global_batch: int, micro_batch: int, valid_sizes: list[int]) -> None:
        super().__init__(
            f"global batch {global_batch} with micro batch {micro_batch} cannot be split over "
            f"{world_size} data-parallel ranks; valid world sizes: {valid_sizes}"
        )
        self.world_size = world_size
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.valid_sizes = valid_sizes


class IncompatibleCheckpoint(TrainerError):
    """The checkpoint to restore was written for another model (or another data set).

    ``tensor`` names the first mismatching tensor in the model's parameter order (``None`` when
    the mismatch is not a tensor, e.g. the data set length). Never retried on an older
    checkpoint: the job's configuration is what has to change.
    """

    def __init__(self, message: str, *, tensor: str | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.step = step


class UnsupportedConfig(TrainerError):
    """The DeepSpeed engine uses a feature the trainer cannot checkpoint (e.g. ZeRO stage 0,
    a non-Adam optimizer, frozen parameters under ZeRO-3, NVMe offload)."""


class StepOutOfOrder(TrainerError):
    """``step_done`` was called without the engine having finished exactly one optimizer step
    (a missing or extra ``engine.step()``, or a batch that was not taken from the trainer)."""


class TrainingDiverged(TrainerError):
    """Training kept failing its health checks (non-finite or spiking loss) even after rolling
    back: more than ``max_rollbacks`` faults within ``rollback_window`` steps, or a fault with no
    checkpoint before it to roll back to.

    Raised on every rank at the same step, after the checkpoints in flight committed (the faulty
    step is never saved). Scripts exit with :data:`stalwart.trainer.EXIT_DIVERGED` so the agent
    (or an operator) can tell divergence from a crash: restarting will not help, the data, the
    learning rate or the limit in ``HealthConfig`` must change. ``rollbacks`` lists the recent
    rollbacks as JSON.
    """

    def __init__(self, message: str, *, step: int, reason: str, rollbacks: list[dict[str, object]]) -> None:
        super().__init__(message)
        self.step = step
        self.reason = reason
        self.rollbacks = rollbacks


class ReformFailed(TrainerError):
    """This rank cannot join the new world in place (no committed checkpoint to resume from, the
    peers never came, the engine could not be rebuilt, no Reform arrived after a lost peer).

    The process is in no usable state: the agent kills it and starts (or assigns) another worker
    for its rank. ``round`` is the round it tried to join (``None``: none was offered).
    """

    def __init__(self, message: str, *, round: int | None = None) -> None:
        super().__init__(message)
        self.round = round
