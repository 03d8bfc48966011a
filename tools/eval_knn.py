#!/usr/bin/env python
"""Weighted kNN of a checkpoint's features: ``python tools/eval_knn.py checkpoint=RUN_DIR [eval.knn.k=20]``."""

import sys

from sslkit.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # before torch is imported

from sslkit.evaluation.tools import knn_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(knn_main())
