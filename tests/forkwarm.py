"""Imported once by the tests' fork server (tests/forkrun.py) before it forks anything: composes the small form of
every recipe there, so that each process forked from it (a rank of a multi-process test, a command of the docs)
finds Hydra's composition and the parsed defaults.yaml in sslkit's per-process caches instead of parsing the YAML
files again: about half a second of a core per process, paid once per server instead. What a process then
composes is what it would have composed itself (the caches are keyed by the config files' paths, times and sizes).
"""

from __future__ import annotations

import contextlib

# imported by every run: once here rather than in each forked process
import torch
import torch.distributed.checkpoint.state_dict  # (the sharded checkpoints' reader and writer)
from helpers import RECIPES, SMALL

import sslkit.config.diff
import sslkit.trainer  # noqa: F401
from sslkit.config.compose import compose_config

# Composing checks some configs with torch ops (ijepa's block masks are drawn once): on one thread here, so that
# OpenMP never starts its thread pool in the server. A pool started before a fork leaves each forked process
# waiting forever on threads it does not have, at its first parallel op (seen with pytest -n0, where the tests'
# processes are not held to one thread by OMP_NUM_THREADS=1 as under xdist).
_threads = torch.get_num_threads()
torch.set_num_threads(1)
for _recipe, _small in RECIPES.items():
    with contextlib.suppress(Exception):  # a recipe that does not compose here fails in its test, not in the server
        compose_config([f"config={_recipe}", *SMALL, *_small])
with contextlib.suppress(Exception):  # the docs' commands: config=simclr on its own data
    compose_config(["config=simclr"])
torch.set_num_threads(_threads)
