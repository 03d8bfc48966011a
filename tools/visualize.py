#!/usr/bin/env python
"""What a trained model learned, as pictures: ``python tools/visualize.py checkpoint=RUN_DIR kind=attention``."""

import sys

from sslkit.launch.runtime import reexec_with_tuned_malloc, run_entry

reexec_with_tuned_malloc()  # before torch is imported

if __name__ == "__main__":
    # main is imported by run_entry: a torchvision that does not load with this torch ends in a message
    sys.exit(run_entry("sslkit.tools.viz:viz_main"))
