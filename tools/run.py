#!/usr/bin/env python
"""Train an SSL model: ``python tools/run.py config=simclr [data=cifar10] [key=value ...]``."""

import sys

from sslkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
