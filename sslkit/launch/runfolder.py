"""A run folder belongs to one config: checked before a resume; an older run is moved aside before a fresh start."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sslkit.checkpoint import Checkpointer
from sslkit.config.diff import flatten_config, show_value
from sslkit.config.run_keys import ELASTIC_KEYS, LENGTHENING_KEYS, ignored
from sslkit.config.text import config_yaml
from sslkit.errors import UserError
from sslkit.files import atomic_write

__all__ = [
    "CONFIG_FILE",
    "FolderPlan",
    "RunFolderError",
    "config_changes",
    "prepare_output_dir",
    "resumable_checkpoint",
    "write_command",
    "write_config",
]

logger = logging.getLogger("sslkit")

#: The resolved config of the run that owns the folder (written at every start, after the check).
CONFIG_FILE = "config.yaml"
#: The command-line arguments of the run's latest start (``sslkit report`` shows the config as a diff
#: against the recipe they name).
COMMAND_FILE = "command.json"
#: Where an older run's files go when a fresh run starts in its folder.
PREVIOUS = "previous"
#: What a run writes into its folder; a fresh start moves these aside.
RUN_FILES = ("config.yaml", "command.json", "log.txt", "metrics.jsonl", "checkpoints", "tensorboard", "eval",
             "report.md", "plots", "trackers.json", "wandb", "viz", "export")

class RunFolderError(UserError):
    """The folder holds a run of a different config; the message names the keys and the ways out."""


@dataclass
class FolderPlan:
    """What :func:`prepare_output_dir` found: a resume (with lengthened or accepted keys) or a fresh start."""

    resume: bool
    #: (key, saved value, new value) of keys that lengthen the run.
    lengthened: list[tuple[str, Any, Any]] = field(default_factory=list)
    #: (key, saved value, new value) of other changed keys, resumed with checkpoint.resume_changed_config=true.
    accepted: list[tuple[str, Any, Any]] = field(default_factory=list)
    #: Where an older run's files were moved (fresh start in a used folder), else None.
    moved_to: str | None = None

    def log(self) -> None:
        """Say what was decided, once the log is set up."""
        if self.moved_to:
            logger.warning("the folder held an earlier run: its files were moved to %s, and this run starts afresh",
                           self.moved_to)
        for key, old, new in self.lengthened:
            logger.info("the run is lengthened: %s %s -> %s; it resumes and trains on. The schedules now span the "
                        "longer run, so from here the lr follows a stretched schedule (a run that is this long "
                        "from the start would differ)", key, old, new)
        for key, old, new in self.accepted:
            logger.warning("resuming with a changed config (checkpoint.resume_changed_config=true): %s %s -> %s",
                           key, old, new)


def _lengthens(key: str, old: Any, new: Any) -> bool:
    if key not in LENGTHENING_KEYS or not isinstance(old, int) or not isinstance(new, int):
        return False
    return new > old or (key == "optim.max_steps" and new == 0 and old > 0)


def config_changes(saved: dict[str, Any], now: dict[str, Any]
                   ) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """Compare two resolved configs: ``(lengthened, changed)`` as lists of (key, saved, now), keys
    of :data:`IGNORED_KEYS` left out. A missing key shows as ``<absent>``."""
    a, b = flatten_config(saved), flatten_config(now)
    # with the same global batch the number of processes only decides how the batch is split (elastic resume)
    elastic = a.get("data.global_batch_size", 0) == b.get("data.global_batch_size", 0) != 0
    lengthened, changed = [], []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, "<absent>"), b.get(key, "<absent>")
        if old == new or ignored(key) or (elastic and key in ELASTIC_KEYS):
            continue
        (lengthened if _lengthens(key, old, new) else changed).append((key, old, new))
    return lengthened, changed


def _usable_folder(out: str) -> None:
    """Make ``out`` and check that files can be written in it; a :class:`UserError` saying why not."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"output_dir={out} is a file, not a folder: set output_dir to a folder (it is made if missing)")
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".sslkit-write-test.{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except NotADirectoryError:
        raise UserError(f"output_dir={out}: a part of that path is a file, not a folder. Set output_dir to a "
                        "path under a folder") from None
    except OSError as exc:
        raise UserError(f"output_dir={out} cannot be written ({exc.strerror or exc}): set output_dir to a folder "
                        "you may write to") from None


def _move_aside(out: str) -> str | None:
    """Move the run files in ``out`` to ``out/previous/<time>``; returns that folder (None if nothing was there)."""
    present = [n for n in RUN_FILES if os.path.lexists(os.path.join(out, n))]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = os.path.join(out, PREVIOUS, stamp)
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(out, PREVIOUS, f"{stamp}-{n}")
    os.makedirs(dest)
    for name in present:
        os.replace(os.path.join(out, name), os.path.join(dest, name))
    return dest


def resumable_checkpoint(cfg: DictConfig) -> str | None:
    """The checkpoint a run of ``cfg`` resumes from: its folder's latest under ``checkpoint.auto_resume``, else None."""
    out = str(cfg.output_dir)
    return Checkpointer(out).latest() if cfg.checkpoint.auto_resume and out else None


def prepare_output_dir(cfg: DictConfig, primary: bool = True) -> FolderPlan:
    """Decide how ``cfg`` uses its ``output_dir``, before anything is built or written.

    * The folder must be (or become) a writable folder, else a :class:`UserError` says why.
    * With ``checkpoint.auto_resume`` and a checkpoint there, the config saved in the folder must
      match ``cfg`` apart from :data:`IGNORED_KEYS` and lengthening keys, else a
      :class:`RunFolderError` names each differing key and the ways out
      (``checkpoint.resume_changed_config=true`` continues anyway).
    * Otherwise the run starts afresh, and files of an earlier run in the folder are moved to
      ``previous/<time>/`` (never deleted, never mixed with the new run's).

    Only the ``primary`` process makes folders or moves files; the others only check.
    """
    out = str(cfg.output_dir)
    if primary:
        _usable_folder(out)
    ckpt = resumable_checkpoint(cfg)
    if ckpt is None:
        return FolderPlan(resume=False, moved_to=_move_aside(out) if primary else None)
    saved_path = os.path.join(out, CONFIG_FILE)
    if not os.path.exists(saved_path):
        logger.warning("%s has a checkpoint but no %s: cannot check that it belongs to this config", out, CONFIG_FILE)
        return FolderPlan(resume=True)
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_path), resolve=True)
    except Exception as exc:  # a hand-edited or torn file
        raise RunFolderError(f"{saved_path} cannot be read ({exc}); it says which config the checkpoints in "
                             f"{out} belong to. Restore it, or set a new output_dir.") from None
    now = OmegaConf.to_container(cfg, resolve=True)
    lengthened, changed = config_changes(saved, now)  # type: ignore[arg-type]
    if changed and not cfg.checkpoint.resume_changed_config:
        lines = "\n".join(f"  {k}: {show_value(old)} (saved) -> {show_value(new)} (now)" for k, old, new in changed)
        raise RunFolderError(
            f"output_dir={out} holds a run of another config (checkpoint {os.path.basename(ckpt)}); these keys "
            f"differ from its {CONFIG_FILE}:\n{lines}\n"
            "Resuming would mix two configs in one run, and its results would belong to neither. Either:\n"
            "  - start a new run elsewhere: output_dir=<a new folder> (or name=<a new name>), or\n"
            "  - start afresh in this folder: checkpoint.auto_resume=false (the old run's files are moved to "
            f"{os.path.join(out, PREVIOUS)}/, not deleted), or\n"
            "  - continue this run with the new values: checkpoint.resume_changed_config=true.\n"
            "(optim.epochs and optim.max_steps may grow: the run then resumes and trains on.)")
    return FolderPlan(resume=True, lengthened=lengthened, accepted=changed)


def write_config(cfg: DictConfig) -> str:
    """Write the resolved config as ``<output_dir>/config.yaml`` atomically; returns its text."""
    text = config_yaml(cfg)
    path = os.path.join(str(cfg.output_dir), CONFIG_FILE)
    atomic_write(path, lambda f: f.write(text.encode()))
    return text


def write_command(output_dir: str, argv: list[str]) -> str:
    """Write ``<output_dir>/command.json``: the arguments of this start (``config=simclr a.b=c ...``), which
    the run report turns into the config's difference from its recipe, secrets hidden
    (:func:`~sslkit.config.secrets.redact_overrides`); returns the path."""
    import json

    from sslkit.config.secrets import redact_overrides

    path = os.path.join(output_dir, COMMAND_FILE)
    text = json.dumps({"argv": redact_overrides(list(argv))}, indent=1)
    atomic_write(path, lambda f: f.write(text.encode()))
    return path
