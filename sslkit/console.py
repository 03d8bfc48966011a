"""What every command-line entry point shares: the log's set-up, the ``--debug`` flag, and spawned workers' exits.

Light to import (no torch): the entry points import it before they know whether they will train."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

from sslkit.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_STOPPED

__all__ = ["debug_flag", "end_worker", "launch_workers", "setup_logging"]

logger = logging.getLogger("sslkit")


class _Unbroken:
    """A text stream that stops writing, silently, once its reader is gone (a closed pipe, ``... | tee log`` whose
    ``tee`` died with a Ctrl-C to the group): what the process still writes goes to os.devnull, so finishing the
    step, the checkpoint and exit 75 never meet a BrokenPipeError. The run's log.txt keeps every line."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):  # EPIPE, ECONNRESET, EBADF; ValueError: the stream was closed
                self._break()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._break()

    def _break(self) -> None:
        self.broken = True
        try:  # the interpreter's own flush at exit would fail too (exit 120): the descriptor now leads nowhere
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def guard_streams() -> None:
    """Make this process's own stdout and stderr :class:`_Unbroken` (once; streams a caller replaced, such as a
    test's capture, are left alone). Called by the entry points and by :func:`setup_logging` (every rank)."""
    if sys.stdout is sys.__stdout__ and sys.stdout is not None:
        sys.stdout = _Unbroken(sys.stdout)
    if sys.stderr is sys.__stderr__ and sys.stderr is not None:
        sys.stderr = _Unbroken(sys.stderr)


def setup_logging(output_dir: str | None, rank: int = 0) -> None:
    """Log to stdout (rank 0; warnings only elsewhere) and to ``<output_dir>/log.txt`` on rank 0. This process's
    stdout and stderr become :func:`guard_streams`' first: a reader that goes away costs nothing but the output."""
    guard_streams()
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    fmt = logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    stream.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.addHandler(stream)
    if output_dir is not None and rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        file = logging.FileHandler(os.path.join(output_dir, "log.txt"))
        file.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(message)s"))
        logger.addHandler(file)


def debug_flag(args: list[str]) -> tuple[list[str], bool]:
    """``--debug`` (or ``SSLKIT_DEBUG=1``): tracebacks for the errors that are otherwise a message. Returns the
    arguments without the flag, and whether it is on."""
    flag = "--debug" in args
    return [a for a in args if a != "--debug"], flag or os.environ.get("SSLKIT_DEBUG", "") not in ("", "0")


def launch_workers(fn: Any, fn_args: tuple[Any, ...], who: str = "sslkit", then: str = "", **launch_kwargs: Any) -> int:
    """Run ``fn(*fn_args)`` in spawned workers (:func:`sslkit.distributed.launch` with ``launch_kwargs``) and
    turn a worker's failure into a line on stderr from ``who`` (ending with ``then``) and an exit status:
    a worker that ended itself on a user's error (:func:`end_worker`) passes its status on, with its message
    already printed by rank 0; a worker that raised printed its traceback itself."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from sslkit.distributed import launch
    from sslkit.errors import PREEMPTED_EXIT_CODE

    try:
        launch(fn, fn_args, **launch_kwargs)
    except ProcessExitedException as exc:
        if exc.exit_code == PREEMPTED_EXIT_CODE:
            print(f"{who}: pre-empted; the checkpoint was written. Run the same command again to resume.",
                  file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        if exc.exit_code in (EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_INTERRUPTED):  # the worker printed why
            print(f"{who}: worker {exc.error_index} stopped (exit {exc.exit_code}, its message is above); all "
                  "workers were stopped.", file=sys.stderr)
            return exc.exit_code
        print(f"{who}: a worker died ({exc}); all workers were stopped.{then}", file=sys.stderr)
        return EXIT_STOPPED
    except ProcessRaisedException:  # each failed worker printed its own traceback (distributed._worker)
        print(f"{who}: a worker failed, so all workers were stopped; each failed worker's traceback is above, "
              f"the first one is the cause.{then}", file=sys.stderr)
        return EXIT_STOPPED
    return 0


def end_worker(exc: BaseException, who: str = "sslkit", what: str = "error") -> NoReturn:
    """End a spawned worker on a user's error (or a halt) without a traceback: rank 0 prints
    ``"<who>: <what>: <exc>"``, and every rank exits with the error's status, which
    :func:`launch_workers` passes on."""
    from sslkit.distributed import get_rank

    if get_rank() == 0:
        print(f"{who}: {what}: {exc}", file=sys.stderr)
    sys.exit(getattr(exc, "exit_code", EXIT_STOPPED))
