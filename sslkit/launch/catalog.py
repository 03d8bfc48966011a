"""What a config can name, one line each: recipes, data presets, registered names (``sslkit list``, ``--help``)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

__all__ = ["catalog_text", "description", "presets", "registered", "usage_text", "yaml_description"]

#: Longest line of a listing; longer descriptions are cut at a word and end in "...".
LINE_WIDTH = 120
#: Registries in the order listed, with the config key that picks a name from each.
_SECTIONS = (
    ("method", "methods", "method.name=NAME"),
    ("trunk", "trunks", "model.trunk=NAME"),
    ("head", "heads", "model.head.name=NAME"),
    ("model", "models", "model.name=NAME"),
    ("loss", "losses", "loss.name=NAME"),
    ("hook", "hooks", "hooks=[{name: NAME}] adds one"),
    ("train_step", "train steps", "train_step=NAME"),
    ("transform", "transforms", "data.transform.name=NAME"),
    ("masking", "mask generators", "masking.name=NAME"),
    ("dataset", "datasets", "data.train.source=NAME"),
)
_ABBREVIATIONS = ("e.g.", "i.e.", "al.", "etc.", "vs.", "cf.")


def _first_sentence(text: str) -> str:
    """The first sentence of ``text`` (a period followed by a space or the end, outside parentheses and
    abbreviations such as "et al."), on one line, with reST markup made plain (````x```` -> ```x```)."""
    text = " ".join(text.split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)  # :class:`X` -> X
    text = text.replace("``", "`").replace("**", "")
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if (ch == "." and depth <= 0 and (i + 1 == len(text) or text[i + 1] == " ")
                and not text[: i + 1].endswith(_ABBREVIATIONS)):
            return text[: i + 1]
    return text


def _cut(text: str, width: int) -> str:
    """``text`` if it fits in ``width`` characters, else its words that fit and "..."."""
    if len(text) <= width:
        return text
    return text[: max(width - 3, 0)].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def description(obj: Any) -> str:
    """One line about a registered object: the first sentence of its own docstring ("" without one); for a
    method, what it is made of and the hooks it requires, then its summary."""
    from sslkit.methods.base import Method

    if isinstance(obj, Method):
        required = ", ".join(obj.required_hooks) or "none"
        masks = f", {obj.masking} masks" if obj.masking else ""
        return (f"model {obj.model}, loss {obj.loss}, {obj.transform} views{masks}; requires hooks: {required}. "
                f"{_first_sentence(obj.summary)}")
    doc = obj.__doc__ if inspect.isclass(obj) or inspect.isroutine(obj) else inspect.getdoc(obj)
    if not doc:
        return ""
    paragraph = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return _first_sentence(paragraph)


def yaml_description(path: Path) -> str:
    """One line about a recipe or data preset: the first sentence of its leading comment block (the
    comment lines after any ``# @package`` line), "" when it starts with no comment."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("# @package"):
            continue
        if not stripped.startswith("#"):
            break
        lines.append(stripped.lstrip("#").strip())
    return _first_sentence(" ".join(lines)) if lines else ""


def presets(group: str) -> dict[str, str]:
    """``config`` (recipes) or ``data`` (data presets): name -> description, from every folder of
    :data:`sslkit.config.schema.CONFIG_DIRS` (the first folder that has a name wins, as in Hydra)."""
    from sslkit.config.schema import config_dirs

    found: dict[str, Path] = {}
    for folder in config_dirs():
        for path in sorted((Path(folder) / group).glob("*.yaml")):
            found.setdefault(path.stem, path)
    return {name: yaml_description(found[name]) for name in sorted(found)}


def registered() -> dict[str, dict[str, str]]:
    """Registry name -> {registered name -> description}, after importing sslkit's own registrations."""
    import sslkit.data
    import sslkit.hooks
    import sslkit.methods
    import sslkit.models
    import sslkit.models.masking
    import sslkit.reliability
    import sslkit.train_steps.standard  # noqa: F401
    from sslkit.registry import REGISTRIES

    return {kind: {name: description(obj) for name, obj in sorted(REGISTRIES[kind])} for kind, _, _ in _SECTIONS}


def _table(sections: list[tuple[str, dict[str, str]]]) -> str:
    out = []
    for header, rows in sections:
        width = max(map(len, rows), default=0) + 2
        out.append(header)
        out.extend(f"  {name.ljust(width)}{_cut(text, LINE_WIDTH - 2 - width)}".rstrip() for name, text in rows.items())
        if not rows:
            out.append("  (none)")
        out.append("")
    return "\n".join(out).rstrip()


def catalog_text() -> str:
    """Every recipe, data preset and registered name (trunks, heads, models, losses, hooks, train steps,
    transforms, datasets), one line each, under a header per section that says how to pick one."""
    regs = registered()
    sections = [("recipes (config=NAME):", presets("config")), ("data presets (data=NAME):", presets("data"))]
    sections += [(f"{title} ({how}):", regs[kind]) for kind, title, how in _SECTIONS]
    return _table(sections)


def usage_text() -> str:
    """The ``--help`` text of ``tools/run.py``: usage, override grammar, where keys are documented, the
    debug switch, and the recipes and data presets."""
    head = """\
usage: python tools/run.py [config=NAME] [data=NAME] [key=value ...] [--debug]

Trains a self-supervised model: defaults (sslkit/config/defaults.yaml), then a data preset, then a
recipe (its own data sizes win over the preset's), then your overrides. A run continues from its
latest checkpoint when started again.

overrides:
  config=NAME      the recipe: configs/config/NAME.yaml (method, model, loss, optimizer)
  data=NAME        the data preset: configs/data/NAME.yaml (source, image size, augmentation)
  key=value        set a key, e.g. optim.lr=0.1 data.batch_size=128 optim.betas=[0.9,0.99]
  +key=value       add a key the config does not have (in free-form sections: builder arguments)
  ~key             delete a key
Every key is in sslkit/config/defaults.yaml, with what it does; docs/configs.md explains them.
A key that does not exist is an error naming the closest one, before anything runs.

--debug (or SSLKIT_DEBUG=1) shows the full traceback of an error instead of its message.

"""
    sections = [("recipes (config=NAME):", presets("config")), ("data presets (data=NAME):", presets("data"))]
    tail = ("python -m sslkit list (or `sslkit list`) lists the trunks, heads, models, losses, hooks, train "
            "steps,\ntransforms, mask generators and datasets that a config can name.")
    return f"{head}{_table(sections)}\n\n{tail}"
