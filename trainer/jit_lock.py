"""Torch's lock for building C++ extensions, made safe against a holder that dies.

DeepSpeed JIT-loads its C++ ops (on the CPU accelerator: the shared-memory collectives, CPU
Adam) through ``torch.utils.cpp_extension.load``. Every process that loads one takes torch's
lock file in the op's build directory, runs ninja (a no-op once built, a full compile the first
time or after an interrupted build) and removes the file; the others poll until it is gone. A
process killed in between (a fault injected or real, an agent stopping a worker that has not
connected yet) leaves the file behind, and every later worker and spare on the node then waits
on it forever: the job never takes another step.

:func:`guard_extension_builds` makes torch's lock a kernel lock (``flock`` on a file beside it,
released when its holder dies, however it dies). Whoever holds that lock is the only process of
this guard inside the build, so a torch lock file it finds was left by a dead holder and is
removed. The processes take turns (as with torch's lock), each running ninja itself.
"""

from __future__ import annotations

import fcntl
import logging
import os

log = logging.getLogger(__name__)

_installed = False


def guard_extension_builds() -> None:
    """Install the guard in this process (idempotent). Call before DeepSpeed loads an op: the
    trainer does in :meth:`~stalwart.trainer.Trainer.initialize`; a script that builds an op
    itself earlier (a ``DeepSpeedCPUAdam`` made before it) calls this first."""
    global _installed
    if _installed:
        return
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    class KernelLockedBaton(FileBaton):  # type: ignore[misc]
        """torch's baton, taken only while holding an ``flock`` that dies with its holder."""

        _fd: int | None = None

        def try_acquire(self) -> bool:
            fd = os.open(self.lock_file_path + ".flock", os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another process builds; never past its death
            if os.path.exists(self.lock_file_path):
                log.warning("removing %s, left by a process that died while it built or checked a C++ "
                            "extension (every later load would have waited on it forever)", self.lock_file_path)
                try:
                    os.remove(self.lock_file_path)
                except FileNotFoundError:
                    pass
            if not super().try_acquire():  # a process without this guard took it meanwhile: wait for it
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                return False
            self._fd = fd
            return True

        def release(self) -> None:
            try:
                super().release()
            finally:
                if self._fd is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    os.close(self._fd)
                    self._fd = None

    cpp_extension.FileBaton = KernelLockedBaton  # type: ignore[misc]
    _installed = True
