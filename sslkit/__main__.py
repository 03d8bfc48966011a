"""``python -m sslkit``: the sslkit command (``python -m sslkit list`` shows what a config can name)."""

from sslkit.launch.cli import console

raise SystemExit(console())
