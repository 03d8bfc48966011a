#!/usr/bin/env python
"""Linear probe on a checkpoint's frozen trunk: ``python tools/eval_linear.py checkpoint=RUN_DIR``."""

import sys

from sslkit.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # before torch is imported

from sslkit.evaluation.tools import linear_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(linear_main())
