"""Config values that are never written or printed: the credentials a remote filesystem takes
(``data.storage_options``), kept out of config.yaml, command.json, every checkpoint and the log."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["HIDDEN", "SECRET_SECTIONS", "hidden_value", "redact_config", "redact_overrides"]

#: Config sections whose values may be credentials.
SECRET_SECTIONS = ("data.storage_options",)
#: Options of those sections that are no secret and that a run folder keeps, so that a tool reading the run reaches
#: its data (its credentials then come from the environment or a profile). Every other option is hidden.
PLAIN_OPTIONS = ("endpoint_url", "anon", "region_name", "requester_pays", "use_ssl", "default_block_size",
                 "project", "version_aware", "client_kwargs.endpoint_url", "client_kwargs.region_name")
#: What a hidden value is shown as.
HIDDEN = "<hidden>"


def _section(key: str) -> tuple[str, str] | None:
    """(secret section, the option's dotted path inside it) for a key in one, else None."""
    for section in SECRET_SECTIONS:
        if key == section:
            return section, ""
        if key.startswith(section + "."):
            return section, key[len(section) + 1:]
    return None


def hidden_value(key: str, value: Any) -> Any:
    """``value`` as it may be shown for the dotted config ``key``: :data:`HIDDEN` for a secret option (a whole secret
    section: its plain options only)."""
    found = _section(key)
    if found is None:
        return value
    if not found[1]:
        return _plain(value) if isinstance(value, dict) else HIDDEN
    return value if found[1] in PLAIN_OPTIONS else HIDDEN


def _plain(options: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for k, v in options.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and any(p.startswith(path + ".") for p in PLAIN_OPTIONS):
            inner = _plain(v, path + ".")
            if inner:
                kept[k] = inner
        elif path in PLAIN_OPTIONS:
            kept[k] = v
    return kept


def redact_config(container: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config (as plain containers) whose secret sections keep their plain options only: what may be
    written to a run folder or a checkpoint."""
    out = copy.deepcopy(container)
    for section in SECRET_SECTIONS:
        *parents, last = section.split(".")
        node: Any = out
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(last), dict):
            node[last] = _plain(node[last])
    return out


def redact_overrides(argv: list[str]) -> list[str]:
    """Command-line overrides as they may be written or shown: ``key=value`` of a secret option becomes
    ``key=<hidden>`` (a whole section given at once: hidden whole)."""
    out = []
    for arg in argv:
        key, eq, _ = arg.partition("=")
        found = _section(key.lstrip("+~")) if eq else None
        if found is not None and not (found[1] and found[1] in PLAIN_OPTIONS):
            arg = f"{key}={HIDDEN}"
        out.append(arg)
    return out
