"""An entry point's process set-up: glibc malloc thresholds before torch loads, and a torch/torchvision pair that
does not load said in a message, not a traceback."""

from __future__ import annotations

import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable

from sslkit.errors import EXIT_BAD_INPUT

__all__ = ["TUNED_MALLOC", "matching_torchvision", "pair_note", "pair_problem", "reexec_with_tuned_malloc", "run_entry",
           "torch_pair"]

#: glibc's malloc thresholds a training process runs with (see :func:`reexec_with_tuned_malloc`).
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def reexec_with_tuned_malloc() -> None:
    """Re-execute this Python command once with glibc's mmap/trim thresholds raised (Linux only).

    glibc hands every freed buffer above 32 MB (a batch's activations) back to the kernel and
    zero-faults it in again on the next step: up to 40% of a CPU training step in system time
    (measured: 500 -> 900 img/s for the SimCLR recipe). The thresholds are read at process start,
    so they cannot be set later; ``SSLKIT_MALLOC_TUNED=1`` marks the re-executed process (and
    lets a user opt out by setting it beforehand).
    """
    if sys.platform.startswith("linux") and os.environ.get("SSLKIT_MALLOC_TUNED") is None:
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, **TUNED_MALLOC, "SSLKIT_MALLOC_TUNED": "1"})


def torch_pair() -> tuple[str | None, str | None]:
    """``(torch, torchvision)``: the installed versions, from the packages' metadata (nothing imported); None for
    one that is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return installed("torch"), installed("torchvision")


def _minor(version: str | None, major: str) -> int | None:
    found = re.match(rf"{major}\.(\d+)", version or "")
    return int(found.group(1)) if found else None


def matching_torchvision(torch_version: str | None) -> str | None:
    """The torchvision series of a torch 2.x release (``2.13.0`` -> ``0.28``: torchvision 0.15 came with torch 2.0,
    and each minor release since with the next); None for another torch."""
    minor = _minor(torch_version, "2")
    return None if minor is None else f"0.{minor + 15}"


def pair_note(torch_version: str | None, vision_version: str | None) -> str:
    """``""`` when the two releases pair (or cannot be told apart), else what the torchvision was made for."""
    series = matching_torchvision(torch_version)
    minor = _minor(vision_version, "0")
    if series is None or minor is None or minor < 15 or series == f"0.{minor}":
        return ""
    return f"torchvision {vision_version} is the release for torch 2.{minor - 15}, not {torch_version}"


def pair_problem(exc: BaseException) -> str | None:
    """What to tell the user when ``exc`` is torchvision failing while it is imported (its C++ operators built for
    another torch: ``operator torchvision::nms does not exist``); None for any other error."""
    if not isinstance(exc, Exception):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    importing = any(f.name == "<module>" and f"{os.sep}torchvision{os.sep}" in f.filename for f in frames)
    if not importing and "torchvision::" not in str(exc):
        return None
    torch_v, vision_v = torch_pair()
    note = pair_note(torch_v, vision_v)
    built = f"; {note}" if note else ""
    series = matching_torchvision(torch_v)
    fix = (f"pip install 'torchvision=={series}.*' from the index this torch came from (a CPU-only torch: "
           f"--index-url https://download.pytorch.org/whl/cpu)" if series else "install the torchvision of this torch")
    first = " ".join(str(exc).split())[:200]
    return (f"torchvision {vision_v or '?'} does not load with torch {torch_v or '?'} ({type(exc).__name__}: "
            f"{first}){built}. Install the torchvision that pairs with this torch: {fix}, or both together: pip "
            f"install --force-reinstall torch torchvision. sslkit doctor reports the pair.")


def run_entry(target: str | Callable[[], int]) -> int:
    """Run an entry point's main (``"module:function"``, imported here, or the function) and return its exit status;
    a torchvision that does not load with this torch ends with :func:`pair_problem`'s message and exit 2."""
    try:
        if isinstance(target, str):
            module, name = target.split(":")
            target = getattr(importlib.import_module(module), name)
        return int(target())
    except Exception as exc:
        problem = pair_problem(exc)
        if problem is None:
            raise
        print(f"sslkit: error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
