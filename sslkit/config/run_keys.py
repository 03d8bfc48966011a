"""Which config keys change what a run computes: what a resume compares, and what names a default run folder."""

from __future__ import annotations

import hashlib
import re

__all__ = ["ELASTIC_KEYS", "IGNORED_KEYS", "LENGTHENING_KEYS", "folder_suffix", "ignored"]

#: Keys that do not change what is computed, only where, how fast or how it is reported: a run
#: resumes with new values of these without a word. (Prefixes end with a dot.)
IGNORED_KEYS = (
    "name", "output_dir", "imports", "machine.device", "machine.num_threads", "data.num_workers",
    "data.pin_memory", "log.", "checkpoint.", "reliability.", "eval.", "distributed.backend",
    "distributed.timeout_s", "distributed.master_addr", "distributed.master_port", "distributed.node_rank",
    "distributed.consistency_check_every_n_steps", "launcher", "slurm.", "data.storage_options",
    "data.storage_options.", "data.cache_dir", "data.read_attempts", "data.read_backoff_s", "data.cache_gb",
)
#: Keys that only split the global batch differently when ``data.global_batch_size`` is set: a run resumes with new
#: values of these without a word (the number of processes, the strategy, the micro-batches).
ELASTIC_KEYS = ("distributed.nproc_per_node", "distributed.num_nodes", "distributed.strategy", "data.batch_size",
                "optim.micro_batches")
#: Keys whose larger value only lengthens the run: it resumes and trains on (``max_steps`` 0 means
#: "the epochs decide", which lengthens a run that was cut by steps).
LENGTHENING_KEYS = ("optim.epochs", "optim.max_steps")
#: The longest suffix :func:`folder_suffix` writes out; a longer one is cut and ends with a hash of the whole.
MAX_SUFFIX = 64


def ignored(key: str) -> bool:
    """Whether ``key`` is one of :data:`IGNORED_KEYS` (or under one of its prefixes)."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in IGNORED_KEYS)


def folder_suffix(overrides: list[str]) -> str:
    """What a default run folder adds to ``runs/<config>-<data>``: each command-line override that changes what
    trains (not :data:`IGNORED_KEYS`, not :data:`LENGTHENING_KEYS`: a longer run trains on in its folder), sorted by
    key, as ``-key=value`` with characters a folder name should not hold replaced by ``_``; ``""`` when there is
    none. The same command finds its own folder again (and resumes there); another command starts its own run.
    Past :data:`MAX_SUFFIX` characters it is cut and ends with 8 hex digits of a hash of the whole."""
    kept = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if not ignored(key) and key not in LENGTHENING_KEYS:
            kept.append((key, override.lstrip("+")))
    parts = [re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9._,=+~-]", "_", text)).strip("_") for _, text in sorted(kept)]
    suffix = "".join(f"-{p}" for p in parts)
    if len(suffix) <= MAX_SUFFIX:
        return suffix
    digest = hashlib.sha1(" ".join(text for _, text in sorted(kept)).encode()).hexdigest()[:8]
    return f"{suffix[:MAX_SUFFIX - 9].rstrip('-_')}-{digest}"
