"""Run by test_export.py (ranks in torchrun's environment): train configs of zero_child's model and keep references.

    export_child.py OUT CONFIGS     train 4 steps per config (checkpoints at steps 2 and 4) and
                                    write the gathered fp32 weights of both as OUT/ref-<cfg>-<step>.npz
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
from zero_child import make_trainer, train


def main() -> None:
    out, names = sys.argv[1], sys.argv[2].split(",")
    for name in names:
        train(make_trainer(name, os.path.join(out, "ckpt")), out, name)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
