"""Integer seed mixing shared by the data sources and the dataset wrapper, and hashed uniforms for data drawn as a
pure function of its index."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["hashed_uniforms", "mix_seed"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """The splitmix64 finaliser: a bijection on 64-bit integers with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*values: int) -> int:
    """Mix integers into one seed in ``[0, 2**63)``, deterministic across processes and runs.

    Unlike ``hash(tuple)``, the result does not depend on ``PYTHONHASHSEED``. Each value is folded
    in through a 64-bit bijection, so different tuples of non-negative integers below ``2**64``
    give different seeds with overwhelming probability (and order matters: ``(1, 2) != (2, 1)``).
    """
    h = 0x243F6A8885A308D3 ^ len(values)
    for v in values:
        h = _splitmix64(h ^ (int(v) & _MASK64))
    return h >> 1


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on an array of uint64 (arithmetic modulo 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hashed_uniforms(key: Sequence[int], indices: np.ndarray, count: int) -> np.ndarray:
    """``count`` uniforms in [0, 1) for each of ``indices`` ``[B]``, a pure function of (``key``, index, position):
    a counter-based hash (splitmix64 chained over the key, then over the word's position), integer arithmetic only,
    so the same on every machine, numpy version and batching. Returns float64 ``[B, count]``."""
    with np.errstate(over="ignore"):
        h = np.full(len(indices), 0x243F6A8885A308D3 ^ len(key), dtype=np.uint64)
        for v in key:
            h = _splitmix64_array(h ^ np.uint64(int(v) & int(_MASK64)))
        h = _splitmix64_array(h ^ np.asarray(indices, dtype=np.uint64))
        positions = np.arange(count, dtype=np.uint64)[None, :] * np.uint64(0xD1B54A32D192ED03)
        words = _splitmix64_array(h[:, None] ^ positions)
    return (words >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
