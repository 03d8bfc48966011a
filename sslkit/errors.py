"""Errors a user can cause and fix: each carries a message that says what is wrong and what to do, an exit code, and
the one "Did you mean ...?" of sslkit (config keys, group options, registered names)."""

from __future__ import annotations

import difflib
import errno
import os
from collections.abc import Iterable

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "EXIT_STOPPED", "PREEMPTED_EXIT_CODE", "RENAMED", "StorageError",
           "UserError", "did_you_mean", "plural", "storage_error", "worker_message"]

#: Keys renamed when every counter took one word, "step" for an optimizer step (docs/configs.md, Renamed keys): the
#: old last part of a key -> the new one, in any section (``gram.start_update`` -> ``gram.start_step``).
RENAMED: dict[str, str] = {
    "start_update": "start_step",
    "ramp_updates": "ramp_steps",
    "warmup_teacher_temp_iters": "warmup_teacher_temp_steps",
    "freeze_prototypes_iters": "freeze_prototypes_steps",
    "queue_start_iter": "queue_start_step",
    "accumulate_steps": "micro_batches",
}

#: Exit status for bad input (a config, a path, a folder that cannot be used): fix it and run again.
EXIT_BAD_INPUT = 2
#: Exit status of a run that stopped on purpose or could not go on (a halt, a full disk).
EXIT_STOPPED = 1
#: Exit status of a pre-empted run (EX_TEMPFAIL: "try again later"): its checkpoint is written and the same command
#: resumes it.
PREEMPTED_EXIT_CODE = 75
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


def _shallowest(owners: list[str]) -> str | None:
    """The one key of ``owners`` with the fewest sections (``optim.lr`` among ``optim.lr``, ``eval.linear.lr``), or
    None when several are as shallow."""
    depth = min(o.count(".") for o in owners)
    top = [o for o in owners if o.count(".") == depth]
    return top[0] if len(top) == 1 else None


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """`` Did you mean 'X'?`` for the option closest to ``name``, or "" when none is close; for a renamed key
    (:data:`RENAMED`), `` It was renamed 'Y'.``

    Dotted keys are compared by their last part when the sections match (``optim.moment`` ->
    ``optim.momentum``; the shared ``optim.`` must not make ``optim.xyz`` look like ``optim.eta``),
    and as whole strings otherwise; a name inside an option of its section (``decay`` in
    ``weight_decay``), or a key whose last part is exactly one option's last part (``optim.batch_size`` ->
    ``data.batch_size``; among several such keys the one with the fewest sections: ``lr`` -> ``optim.lr``, not
    ``eval.linear.lr``), also counts as close.
    """
    close = 0.75  # difflib ratio; "log" for "confg" (0.5) is not close, "optim.lr" for "optim.lrr" (0.8) is
    parent, _, leaf = name.rpartition(".")
    if leaf in RENAMED:
        new = f"{parent}.{RENAMED[leaf]}" if parent else RENAMED[leaf]
        return f" It was renamed '{new}' (docs/configs.md, Renamed keys)."
    leaf_owners: dict[str, list[str]] = {}
    options = list(options)
    for option in options:
        leaf_owners.setdefault(option.rpartition(".")[2], []).append(option)
    best, best_score = "", 0.0
    for option in dict.fromkeys(options):
        o_parent, _, o_leaf = option.rpartition(".")
        if option == name or name.startswith(option + "."):  # not the key itself, nor its own section
            continue
        a, b = (leaf, o_leaf) if o_parent == parent else (name, option)
        score = difflib.SequenceMatcher(None, a, b).ratio()
        if o_parent == parent and len(a) >= 4 and a in b:
            score = max(score, close)
        if o_parent != parent and leaf == o_leaf and option == _shallowest(leaf_owners[o_leaf]):
            score = max(score, 0.9)  # above a name inside an option: epochs -> optim.epochs, not warmup_epochs
        if score > best_score:
            best, best_score = option, score
    return f" Did you mean '{best}'?" if best_score >= close else ""


def plural(n: int, noun: str) -> str:
    """``"1 epoch"``, ``"3 epochs"``: a count and its noun for a message (an English ``s`` plural)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def worker_message(text: str) -> str:
    """The message of an error raised in a DataLoader worker as the user should read it: torch re-raises it in the
    main process as ``Caught X in DataLoader worker process N.\nOriginal Traceback ...``, the worker's traceback in the
    text; this keeps the original message (the traceback's last line, less the exception's name), saying where it
    was raised. Any other text is returned as it is."""
    head, sep, trace = text.partition("\nOriginal Traceback (most recent call last):")
    if not sep or not head.startswith("Caught "):
        return text
    last = trace.rstrip().rsplit("\n", 1)[-1]
    _, colon, message = last.partition(": ")
    where = head.split(" in ", 1)[1].rstrip(".") if " in " in head else "a loader worker"
    return f"{message if colon else last} (in {where})"

