"""The app's work folder: everything one server process writes to disk, in one folder it removes.

Recordings, download exports, offline MP4s and (when the app is started from the command line)
Gradio's upload and download cache all live under one `lingbot-work-<pid>-*` folder in the temp
directory. The process removes it on shutdown (Ctrl-C, SIGTERM). A process that cannot clean up
(kill -9, a power cut) leaves it behind, so every start-up removes the folders of dead processes.

"Dead" is decided by a lock, not by a pid (pids are reused): the owner holds an exclusive flock on
the folder's lock file for its whole life, and the kernel drops that lock when the process ends,
however it ends. A folder whose lock can be taken has no owner. A folder without a lock file is not
touched: it may be in the middle of being created, or not be ours at all.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "lingbot-work-"
LOCK_NAME = ".owner.lock"


class WorkFolder:
    """One process's work folder, locked for as long as it exists."""

    def __init__(self, path: Path, lock_fd: int, swept: list[Path]) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd
        self.swept = swept  # folders of dead processes removed when this one was created

    @classmethod
    def create(cls, parent: str | os.PathLike | None = None) -> "WorkFolder":
        """Remove dead processes' folders under `parent` (default: the temp directory), then make ours."""
        parent = Path(parent if parent is not None else tempfile.gettempdir())
        swept = remove_stale(parent)
        path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
        # The lock file is locked before it gets its name, so a sweep in another process never sees it
        # unlocked: it either finds no lock file (and leaves the folder alone) or a held lock.
        partial = path / (LOCK_NAME + ".partial")
        fd = os.open(partial, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(partial, path / LOCK_NAME)
        return cls(path, fd, swept)

    def remove(self) -> None:
        """Delete the folder and everything in it, then let go of the lock (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def remove_stale(parent: str | os.PathLike) -> list[Path]:
    """Remove every work folder under `parent` whose owning process has ended; returns them."""
    removed = []
    for folder in Path(parent).glob(PREFIX + "*"):
        if folder.is_symlink() or not folder.is_dir():
            continue
        try:
            fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # no lock file (being created, or not ours), or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process is alive
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed
