#!/usr/bin/env python
"""What a trained model learned, as pictures: ``python tools/visualize.py checkpoint=RUN_DIR kind=attention``."""

import sys

from sslkit.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # before torch is imported

from sslkit.viz import viz_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(viz_main())
