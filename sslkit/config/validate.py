"""Validation of a composed config, in three layers: keys, types and values (:mod:`sslkit.config.values`), the rules
between keys and each method's own (:mod:`sslkit.config.rules`), and what the machine has
(:mod:`sslkit.config.machine`). It never builds a model."""

from __future__ import annotations

from omegaconf import DictConfig

from sslkit.config.machine import check_device, check_hosts, check_paths
from sslkit.config.rules import check_builders, check_freeze, check_method_rules, check_run_length, check_sections
from sslkit.config.schema import ConfigError, schema
from sslkit.config.values import check_tree, check_values

__all__ = ["validate"]


def validate(cfg: DictConfig) -> None:
    """Check a composed config's keys, types, values, registered names, builder arguments, the rules between keys
    (the method's own among them) and what the machine has; raise :class:`ConfigError` with every finding."""
    errors: list[str] = []
    ref = schema()
    check_tree(cfg, ref, "", errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    check_values(cfg, errors)
    if not errors:
        check_device(cfg, errors)
    check_hosts(cfg, errors)
    shaped, steps = check_run_length(cfg, errors)
    check_paths(cfg, errors)

    import sslkit.data
    import sslkit.hooks
    import sslkit.methods
    import sslkit.models
    import sslkit.train_steps.standard  # noqa: F401  (the registrations the names are checked against)

    if shaped:
        check_method_rules(cfg, errors, steps)
    trunk = check_builders(cfg, errors)
    check_sections(cfg, ref, trunk, steps, errors)
    if not errors:
        check_freeze(cfg, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(dict.fromkeys(errors)))  # shared keys: once
