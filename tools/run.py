#!/usr/bin/env python
"""Train an SSL model: ``python tools/run.py config=simclr [data=cifar10] [key=value ...]``."""

import sys

from sslkit.launch.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # before torch is imported

from sslkit.launch.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
