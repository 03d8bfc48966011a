"""Registries reject duplicates and name the closest registered name for a typo."""

from __future__ import annotations

import pytest
from fvcore.common.registry import Registry

from sslkit import registry as R


def test_register_and_get() -> None:
    reg = Registry("thing")

    @R._decorator(reg)("alpha")
    def alpha() -> int:
        return 1

    assert R.get(reg, "alpha") is alpha


def test_duplicate_name_raises() -> None:
    reg = Registry("thing")
    R._decorator(reg)("alpha")(lambda: 1)
    with pytest.raises(AssertionError, match="alpha"):
        R._decorator(reg)("alpha")(lambda: 2)


def test_unknown_name_lists_registered_and_closest() -> None:
    reg = Registry("thing")
    for name in ("resnet18", "resnet50", "small_cnn"):
        R._decorator(reg)(name)(lambda: None)
    with pytest.raises(R.UnknownNameError) as info:
        R.get(reg, "resnt18", where="model.trunk")
    msg = str(info.value)
    assert "Did you mean 'resnet18'?" in msg
    assert "resnet50" in msg and "small_cnn" in msg and "model.trunk" in msg


def test_nothing_close_gives_no_guess() -> None:
    reg = Registry("thing")
    R._decorator(reg)("alpha")(lambda: None)
    with pytest.raises(R.UnknownNameError) as info:
        R.get(reg, "zzzzzz")
    assert "Did you mean" not in str(info.value)


def test_builtin_registries_are_populated() -> None:
    import sslkit.data
    import sslkit.hooks
    import sslkit.methods
    import sslkit.models
    import sslkit.train_steps.standard  # noqa: F401

    assert "standard" in R.TRAIN_STEPS
    assert {"log", "checkpoint", "knn"} <= {k for k, _ in R.HOOKS}
    assert "nt_xent" in R.LOSSES
    assert {"small_cnn", "resnet18", "resnet50"} <= {k for k, _ in R.TRUNKS}
    assert "mlp" in R.HEADS
    assert {"fashion_mnist", "cifar10", "cifar100", "folder", "synthetic"} <= {k for k, _ in R.DATASETS}
    assert {"simclr", "eval"} <= {k for k, _ in R.TRANSFORMS}
