"""Integer seed mixing shared by the data sources and the dataset wrapper."""

from __future__ import annotations

__all__ = ["mix_seed"]

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
