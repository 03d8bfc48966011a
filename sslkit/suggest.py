"""did_you_mean: the one "Did you mean ...?" of sslkit, for config keys, group options and registered names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def _shallowest(owners: list[str]) -> str | None:
    """The one key of ``owners`` with the fewest sections (``optim.lr`` among ``optim.lr``, ``eval.linear.lr``), or
    None when several are as shallow."""
    depth = min(o.count(".") for o in owners)
    top = [o for o in owners if o.count(".") == depth]
    return top[0] if len(top) == 1 else None


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """`` Did you mean 'X'?`` for the option closest to ``name``, or "" when none is close.

    Dotted keys are compared by their last part when the sections match (``optim.moment`` ->
    ``optim.momentum``; the shared ``optim.`` must not make ``optim.xyz`` look like ``optim.eta``),
    and as whole strings otherwise; a name inside an option of its section (``decay`` in
    ``weight_decay``), or a key whose last part is exactly one option's last part (``optim.batch_size`` ->
    ``data.batch_size``; among several such keys the one with the fewest sections: ``lr`` -> ``optim.lr``, not
    ``eval.linear.lr``), also counts as close.
    """
    close = 0.75  # difflib ratio; "log" for "confg" (0.5) is not close, "optim.lr" for "optim.lrr" (0.8) is
    parent, _, leaf = name.rpartition(".")
    leaf_owners: dict[str, list[str]] = {}
    options = list(options)
    for option in options:
        leaf_owners.setdefault(option.rpartition(".")[2], []).append(option)
    best, best_score = "", 0.0
    for option in dict.fromkeys(options):
        o_parent, _, o_leaf = option.rpartition(".")
        if option == name or name.startswith(option + "."):  # not the key itself, nor its own section
            continue
        a, b = (leaf, o_leaf) if o_parent == parent else (name, option)
        score = difflib.SequenceMatcher(None, a, b).ratio()
        if o_parent == parent and len(a) >= 4 and a in b:
            score = max(score, close)
        if o_parent != parent and leaf == o_leaf and option == _shallowest(leaf_owners[o_leaf]):
            score = max(score, 0.9)  # above a name inside an option: epochs -> optim.epochs, not warmup_epochs
        if score > best_score:
            best, best_score = option, score
    return f" Did you mean '{best}'?" if best_score >= close else ""

