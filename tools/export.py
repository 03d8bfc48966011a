#!/usr/bin/env python
"""The trunk for torchvision: ``python tools/export.py checkpoint=RUN_DIR output=encoder.safetensors``."""

import sys

from sslkit.runtime import reexec_with_tuned_malloc

reexec_with_tuned_malloc()  # before torch is imported

from sslkit.evaluation.export import export_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(export_main())
