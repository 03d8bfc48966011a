"""Shared test setup: tests/helpers.py and sslkit_faults importable from every test folder; gpu tests skipped
without CUDA."""

import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "reliability"))  # sslkit_faults: imports=[...] of tests anywhere

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs the suite on as many workers as cores (README: -n auto): one thread each, and
    # the same for the processes a test starts, so the workers share the cores instead of oversubscribing them
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped, not failed, where no CUDA device is visible (CI). Tests marked
    ``multiprocess`` form one pytest-xdist group (used with ``--dist loadgroup``): they run one after another on
    one worker while the others take the rest, so two of them never share the cores with their process groups
    (2 x 2-4 processes on 2 cores made every test beside them several times slower). Tests marked ``beside``
    (the SLURM job, which mostly waits on SLURM, and the throughput benchmark, which asserts no time) form a
    second group that runs beside them."""
    import torch

    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            # (prepended: it overrides a group of the test's own, such as the doc commands')
            if "beside" in item.keywords:  # no deadline of its own (the SLURM job mostly waits on SLURM): beside
                item.add_marker(pytest.mark.xdist_group(name="beside"), append=False)
            elif "multiprocess" in item.keywords:
                item.add_marker(pytest.mark.xdist_group(name="multiprocess"), append=False)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A multi-process test starts its processes from the tests' fork server (tests/forkrun.py: torch imported and
    the small recipes composed once), also where it starts them through sslkit's own launcher in this process
    (benchmarks/memory.py, doctor's collective check): whichever starts the process's fork server first sets what
    it preloads."""
    if "multiprocess" in item.keywords:
        import forkrun

        forkrun.ensure_server()


#: The "sslkit" logger as importing sslkit leaves it (no handler of its own, propagating to the root).
_SSLKIT_LOGGER = logging.getLogger("sslkit")
_LOGGER_BASELINE = (list(_SSLKIT_LOGGER.handlers), _SSLKIT_LOGGER.propagate, _SSLKIT_LOGGER.level)


def _reset_sslkit_logger() -> None:
    handlers, propagate, level = _LOGGER_BASELINE
    for handler in list(_SSLKIT_LOGGER.handlers):
        if handler not in handlers:
            _SSLKIT_LOGGER.removeHandler(handler)
            handler.close()
    _SSLKIT_LOGGER.propagate, _SSLKIT_LOGGER.level = propagate, level


@pytest.fixture(autouse=True)
def _restore_sslkit_logger():
    """A run of ``sslkit.launch.cli.main`` in this process sets up the "sslkit" logger as a run does (its own
    handlers, no propagation). Every test starts and ends with the logger as importing sslkit left it, so that its
    ``caplog`` sees the records whatever ran before it in this worker (a module fixture's run included: a snapshot
    taken at the test's start would keep that run's set-up)."""
    _reset_sslkit_logger()
    yield
    _reset_sslkit_logger()


#: A worker holding more than this many MB after a test gives its free heap back (:func:`_give_back_memory`).
_TRIM_ABOVE_MB = 1500
_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_MB


@pytest.fixture(autouse=True)
def _give_back_memory():
    """After a test that left this worker large (a paper-size ViT's step: 10 GB), its freed memory is given back to
    the system (a garbage collection, then glibc's ``malloc_trim``): freed heap stays resident otherwise, and a
    worker grew to 10 GB on a 24 GB machine. Measured on dinov3_vitb16's first step: 2,134 MB resident after the
    test, 819 MB after this. Only above :data:`_TRIM_ABOVE_MB` (a read of /proc per test otherwise)."""
    yield
    if sys.platform.startswith("linux") and _resident_mb() > _TRIM_ABOVE_MB:
        import ctypes
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def pytest_configure(config: pytest.Config) -> None:
    """The small distillation recipe's teacher file (tests/helpers.RECIPES["distill"] names it) is written before any
    test composes that recipe (once per machine: every later session finds it)."""
    from sslkit.launch.doctor import small_teacher

    small_teacher()
