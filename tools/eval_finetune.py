#!/usr/bin/env python
"""Fine-tune a checkpoint's whole trunk and a linear head: ``python tools/eval_finetune.py checkpoint=RUN_DIR``."""

import sys

from sslkit.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # before torch is imported

from sslkit.evaluation.finetune import finetune_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(finetune_main())
