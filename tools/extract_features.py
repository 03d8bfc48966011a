#!/usr/bin/env python
"""A split's features and labels to a file: ``python tools/extract_features.py checkpoint=RUN_DIR``."""

import sys

from sslkit.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # before torch is imported

from sslkit.evaluation.tools import extract_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(extract_main())
