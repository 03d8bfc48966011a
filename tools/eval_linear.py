#!/usr/bin/env python
"""Linear probe on a checkpoint's frozen trunk: ``python tools/eval_linear.py checkpoint=RUN_DIR``."""

import sys

from sslkit.launch.runtime import reexec_with_tuned_malloc, run_entry

reexec_with_tuned_malloc()  # before torch is imported

if __name__ == "__main__":
    # main is imported by run_entry: a torchvision that does not load with this torch ends in a message
    sys.exit(run_entry("sslkit.tools.common:linear_main"))
