#!/usr/bin/env python
"""Train an SSL model: ``python tools/run.py config=simclr [data=cifar10] [key=value ...]``."""

import os
import sys

# glibc returns every freed buffer above 32 MB (activations of a batch) to the kernel and
# zero-faults it back on the next step: up to 40% of a CPU step in system time. Raising the
# mmap/trim thresholds keeps that memory in the process. They must be set before the process
# starts, so re-exec once with them (benchmarks/overhead.py measures the effect).
_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
if sys.platform.startswith("linux") and os.environ.get("SSLKIT_MALLOC_TUNED") != "1":
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_TUNED, "SSLKIT_MALLOC_TUNED": "1"})

from sslkit.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
