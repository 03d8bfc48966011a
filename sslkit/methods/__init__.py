"""SSL methods, one file each (loss, hooks, head wiring); importing registers them."""

from sslkit.methods import simclr

__all__ = ["simclr"]
