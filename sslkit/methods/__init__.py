"""SSL methods, one file each (loss, hooks, model wiring); importing this package registers them all."""

import importlib

METHODS = ("simclr", "moco", "byol", "simsiam", "swav", "dino", "barlow_twins", "vicreg", "mae", "lejepa", "ibot",
           "dinov2", "dinov3", "ijepa", "distill")

for _name in METHODS:
    importlib.import_module(f"sslkit.methods.{_name}")

__all__ = ["METHODS"]
