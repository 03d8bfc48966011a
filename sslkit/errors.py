"""Errors a user can cause and fix: each carries a message that says what is wrong and what to do, and an exit code."""

from __future__ import annotations

import errno
import os

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "EXIT_STOPPED", "StorageError", "UserError", "storage_error"]

#: Exit status for bad input (a config, a path, a folder that cannot be used): fix it and run again.
EXIT_BAD_INPUT = 2
#: Exit status of a run that stopped on purpose or could not go on (a halt, a full disk).
EXIT_STOPPED = 1
#: Exit status after a second Ctrl-C (stopped at once, no new checkpoint): 128 + SIGINT.
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """A failure the user can fix. ``tools/run.py`` prints the message (no traceback, unless
    ``SSLKIT_DEBUG=1`` or ``--debug``) and exits with :attr:`exit_code`."""

    exit_code = EXIT_BAD_INPUT


class StorageError(UserError):
    """Writing the run's files failed for a reason outside sslkit (no space left, no permission, a
    read-only file system). Nothing half-written is left behind; the message names the file, the last
    checkpoint, and what to do."""

    exit_code = EXIT_STOPPED


#: OS errors that are the machine's, not sslkit's: reported as a message, not a traceback.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG}


def storage_error(exc: OSError, what: str, path: str, latest: str | None = None,
                  known: bool = True) -> StorageError:
    """A :class:`StorageError` for ``exc`` raised while writing ``what`` at ``path``, saying what to do.

    ``latest`` is the checkpoint a rerun resumes from (None: no checkpoint yet); ``known=False``
    when the caller cannot tell.
    """
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    advice = {
        errno.ENOSPC: "Free some space there (or point output_dir at a disk with room; checkpoint.keep_last "
                      "bounds how many checkpoints are kept)",
        errno.EDQUOT: "Free some of your quota there, or point output_dir elsewhere",
        errno.EROFS: "The file system is read-only: set output_dir to a writable folder",
        errno.EACCES: "You may not write there: fix its permissions or set output_dir to a writable folder",
        errno.EPERM: "You may not write there: fix its permissions or set output_dir to a writable folder",
    }.get(exc.errno or 0, "Check the disk and the folder")
    if not known:
        resume = "Checkpoints are written atomically: running the same command resumes from the last complete one."
    elif latest:
        resume = f"The last complete checkpoint, {latest}, is intact: running the same command resumes from it."
    else:
        resume = "No checkpoint was written yet: a rerun starts from the beginning."
    return StorageError(f"cannot write {what} {path}: {reason}. {advice}. {resume}")
