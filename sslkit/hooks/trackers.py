"""Experiment trackers: the log hook's records mirrored into W&B and MLflow runs (log.wandb, log.mlflow)."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sslkit.files import atomic_write

if TYPE_CHECKING:

    from sslkit.task import SSLTask

__all__ = [
    "TRACKERS_FILE",
    "MlflowTracker",
    "Tracker",
    "WandbTracker",
    "default_mlflow_uri",
    "finish_trackers",
    "metric_items",
    "param_value",
    "run_status",
    "trackers_of",
]

logger = logging.getLogger("sslkit")

#: ``<output_dir>/trackers.json``: the W&B run id and the MLflow run id, so that a resumed run continues them.
TRACKERS_FILE = "trackers.json"
#: How a tracker's run ends (MLflow's run statuses; W&B gets an exit code).
FINISHED, KILLED, FAILED = "FINISHED", "KILLED", "FAILED"
#: Seconds to wait for the W&B server (the reachability probe and ``wandb.init``) before logging offline.
WANDB_TIMEOUT_S = 10
#: The W&B metric every ``<phase>/<field>`` is plotted against (W&B's own ``_step`` only counts ``log`` calls).
WANDB_STEP = "step"


def metric_items(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers as ``{"<phase>/<field>": value}`` (the names TensorBoard shows); text records (phase
    ``warning``), ``step``, ``phase`` and booleans give none."""
    phase = record.get("phase", "eval")
    if phase == "warning":
        return {}
    return {f"{phase}/{key}": float(value) for key, value in record.items()
            if key not in ("step", "phase") and not isinstance(value, bool) and isinstance(value, int | float)}


def run_status(error: BaseException | None) -> str:
    """The tracker status for how training ended: FINISHED (no error), KILLED (pre-empted, Ctrl-C), FAILED."""
    from sslkit.reliability import Preempted

    if error is None:
        return FINISHED
    return KILLED if isinstance(error, Preempted | KeyboardInterrupt) else FAILED


class Tracker:
    """A metrics sink that mirrors records into an experiment tracker, and never stops the run: the first
    exception from the tracker's library (a full disk, a server gone) costs one warning naming the tracker and
    the error, and the tracker is off for the rest of the run. Subclasses implement ``_write``, ``_flush``,
    ``_finish`` and ``_abandon``."""

    #: The tracker's name in messages.
    name = "tracker"

    def __init__(self) -> None:
        self.active = True
        self._finished = False

    def write(self, record: dict[str, Any]) -> None:
        """Log the record's numbers (:func:`metric_items`) at its ``step``."""
        if self.active:
            self._guard(self._write, record)

    def close(self) -> None:
        """Flush (the log hook calls this when training ends; :meth:`finish` ends the tracker's run)."""
        if self.active:
            self._guard(self._flush)

    def finish(self, status: str, artifacts_from: str | None = None) -> None:
        """End the tracker's run with ``status`` (once); with ``artifacts_from`` (a run folder), first upload its
        report.md, plots/*.png and eval/*.json."""
        if self._finished:
            return
        self._finished = True
        if self.active:
            self._guard(self._finish, status, artifacts_from)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # any error of the tracker's library: never lose the training run for it
            self.active = False
            logger.warning("%s failed (%s: %s): it is off for the rest of this run; training goes on, and "
                           "metrics.jsonl keeps every record", self.name, type(exc).__name__, exc)
            try:
                self._abandon()
            except Exception:  # the library is already failing: nothing more to say
                pass

    def _write(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        """Nothing buffered by default."""

    def _finish(self, status: str, artifacts_from: str | None) -> None:
        raise NotImplementedError

    def _abandon(self) -> None:
        """Release what can be released after a failure (best effort)."""


def report_files(output_dir: str) -> list[tuple[str, str]]:
    """``(path, folder in the tracker's artifacts)`` of a finished run's report.md, plots/*.png and eval/*.json."""
    root = Path(output_dir)
    files = [(root / "report.md", "")] if (root / "report.md").is_file() else []
    files += [(p, "plots") for p in sorted((root / "plots").glob("*.png"))]
    files += [(p, "eval") for p in sorted((root / "eval").glob("*.json"))]
    return [(str(p), folder) for p, folder in files]


# ------------------------------------------------------------------------------------------------- W&B
class WandbTracker(Tracker):
    """A Weights & Biases run (``wandb.init`` with ``dir`` = the run folder). Its id is kept in trackers.json, so
    a resumed run continues it (``resume="allow"``). Every number is logged as ``<phase>/<field>`` against the
    metric ``step`` (``define_metric``): a resumed run logs again the steps after its checkpoint, which W&B would
    drop as non-increasing ``step=`` values."""

    name = "W&B"

    def __init__(self, output_dir: str, *, project: str, entity: str | None, name: str | None, tags: list[str],
                 mode: str, config: dict[str, Any], resume: bool) -> None:
        super().__init__()
        import wandb

        self._wandb = wandb
        previous = _read_state(output_dir).get("wandb", {}) if resume else {}
        run_id = previous.get("id") or secrets.token_hex(6)
        mode = self._resolve_mode(mode)
        kwargs = {"project": project, "entity": entity, "name": name, "tags": list(tags), "config": config,
                  "dir": output_dir, "id": run_id, "resume": "allow",
                  # the run's log stays in log.txt: W&B does not wrap stdout/stderr (nor the progress bar)
                  "settings": wandb.Settings(init_timeout=WANDB_TIMEOUT_S, console="off")}
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as exc:
            if mode != "online":
                raise
            logger.warning("W&B: wandb.init failed online (%s: %s): logging offline instead", type(exc).__name__,
                           str(exc).splitlines()[0] if str(exc) else "")
            wandb.teardown()  # the failed online attempt holds the run id in wandb's service
            mode = "offline"
            self.run = wandb.init(mode=mode, **kwargs)
        _write_state(output_dir, "wandb", {"id": run_id, "project": project, "entity": entity})
        self.run.define_metric(WANDB_STEP, hidden=True)
        self.run.define_metric("*", step_metric=WANDB_STEP)
        where = getattr(self.run.settings, "sync_dir", None) or os.path.join(output_dir, "wandb")
        if mode == "offline":
            logger.info("W&B: run %s logged offline in %s; `wandb sync %s` uploads it later", run_id, where, where)
        elif mode == "disabled":
            logger.info("W&B: disabled (WANDB_MODE=disabled): nothing is logged")
        else:
            logger.info("W&B: run %s (%s)", run_id, getattr(self.run, "url", None) or mode)

    def _resolve_mode(self, mode: str) -> str:
        """``auto``: WANDB_MODE when set, else online when an API key is available (WANDB_API_KEY, or wandb's
        login: its settings file or netrc) and the server answers, else offline. ``online``: offline (with a
        warning) without an API key or when the server does not answer."""
        env = os.environ.get("WANDB_MODE", "").strip().lower()
        if mode == "auto" and env in ("offline", "dryrun", "disabled", "online"):
            mode = "offline" if env == "dryrun" else env
        if mode in ("offline", "disabled"):
            return mode
        if not self._has_credentials():
            if mode == "online":
                logger.warning("W&B: log.wandb.mode=online but no API key (WANDB_API_KEY or `wandb login`): "
                               "logging offline instead")
            else:
                logger.info("W&B: no API key (WANDB_API_KEY or `wandb login`): logging offline")
            return "offline"
        url = self._base_url()
        problem = _unreachable(url, WANDB_TIMEOUT_S)
        if problem:
            logger.warning("W&B: the server %s cannot be reached (%s): logging offline instead", url, problem)
            return "offline"
        return "online"

    def _has_credentials(self) -> bool:
        """Whether wandb has an API key, without prompting (wandb's ``login(prompt=False)``; the environment
        variables first, which need no call)."""
        if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
            return True
        try:
            return bool(self._wandb.login(prompt=False, verify=False))
        except TypeError:  # a wandb older than login(prompt=...)
            return bool(getattr(getattr(self._wandb, "api", None), "api_key", None))

    def _base_url(self) -> str:
        url = os.environ.get("WANDB_BASE_URL")
        if not url:
            try:
                url = self._wandb.setup().settings.base_url
            except Exception:  # an older wandb
                url = None
        return str(url or "https://api.wandb.ai")

    def _write(self, record: dict[str, Any]) -> None:
        items = metric_items(record)
        if items:
            self.run.log({WANDB_STEP: int(record.get("step", 0)), **items})

    def _finish(self, status: str, artifacts_from: str | None) -> None:
        if artifacts_from is not None:
            for path, _ in report_files(artifacts_from):
                self.run.save(path, base_path=artifacts_from, policy="now")
        if status == KILLED:
            self.run.mark_preempting()  # stopped to be resumed, not crashed
        self.run.finish(exit_code=0 if status == FINISHED else 1)

    def _abandon(self) -> None:
        self.run.finish(exit_code=1)


def _unreachable(url: str, timeout: float) -> str | None:
    """Why ``url`` does not answer within ``timeout`` seconds, or None when it answers (any HTTP status)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except urllib.error.HTTPError:  # an answer, if not a welcome one
        return None
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", None) or exc)


# ------------------------------------------------------------------------------------------------- MLflow
class MlflowTracker(Tracker):
    """An MLflow run, through ``MlflowClient`` and explicit run ids (never the fluent ``mlflow.start_run`` state):
    params = the flattened config, every number as ``<phase>/<field>`` at its step (one ``log_batch`` per
    record), the report and plots as artifacts at the end. Its id is kept in trackers.json, so a resumed run
    continues it (status back to RUNNING)."""

    name = "MLflow"

    def __init__(self, output_dir: str, *, tracking_uri: str | None, experiment: str, run_name: str | None,
                 tags: dict[str, Any], params: dict[str, str], resume: bool) -> None:
        super().__init__()
        import mlflow  # (the package itself: not installed is an ImportError here, whatever submodules are loaded)

        previous = _read_state(output_dir).get("mlflow", {}) if resume else {}
        uri = tracking_uri or previous.get("tracking_uri") or default_mlflow_uri()
        if urllib.parse.urlparse(uri).scheme in ("", "file"):
            # mlflow 3 refuses its file store (in maintenance) unless asked for it: a file: URI is that request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(uri)
        run = None
        if previous.get("run_id") and previous.get("tracking_uri") == uri:
            try:
                run = self.client.get_run(previous["run_id"])
            except mlflow.exceptions.MlflowException as exc:
                logger.warning("MLflow: run %s of this folder is not in %s (%s): starting a new one",
                               previous["run_id"], uri, exc)
        if run is not None:
            self.client.update_run(run.info.run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(experiment_id, run_name=run_name,
                                         tags={str(k): str(v) for k, v in tags.items()})
        self.run_id = run.info.run_id
        _write_state(output_dir, "mlflow", {"run_id": self.run_id, "tracking_uri": uri,
                                            "experiment_id": run.info.experiment_id})
        self._log_params(params, dict(run.data.params))
        logger.info("MLflow: run %s in experiment %r at %s%s", self.run_id, experiment, uri,
                    " (continued)" if previous.get("run_id") == self.run_id else "")

    def _log_params(self, params: dict[str, str], logged: dict[str, str]) -> None:
        """Log the params not logged yet (MLflow's params cannot change; a resumed run whose config changed
        keeps the first values, said once), at most 100 per call."""
        from mlflow.entities import Param

        limit = _mlflow_limit("MAX_PARAM_VAL_LENGTH", 500)
        params = {_mlflow_key(k): v[:limit] for k, v in params.items()}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            logger.info("MLflow: params keep the values of the run's start (MLflow cannot change them): %s",
                        ", ".join(changed))
        todo = [Param(k, v) for k, v in params.items() if k not in logged]
        per_call = _mlflow_limit("MAX_PARAMS_TAGS_PER_BATCH", 100)
        for i in range(0, len(todo), per_call):
            self.client.log_batch(self.run_id, params=todo[i:i + per_call])

    def _write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(record.get("step", 0))
        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in metric_items(record).items()]
        per_call = _mlflow_limit("MAX_METRICS_PER_BATCH", 1000)
        for i in range(0, len(metrics), per_call):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + per_call])

    def _finish(self, status: str, artifacts_from: str | None) -> None:
        if artifacts_from is not None:
            for path, folder in report_files(artifacts_from):
                self.client.log_artifact(self.run_id, path, artifact_path=folder or None)
        self.client.set_terminated(self.run_id, status)

    def _abandon(self) -> None:
        self.client.set_terminated(self.run_id, FAILED)  # its record of the run is incomplete


def default_mlflow_uri() -> str:
    """The store of a run that names none: ``MLFLOW_TRACKING_URI`` when set, else MLflow's own default, a SQLite
    database ``mlflow.db`` in the working folder where the run starts, as an absolute URI (a resume from elsewhere
    keeps it: trackers.json holds it), so that ``mlflow ui`` started in that folder opens it."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"


def _mlflow_key(key: str) -> str:
    """A param or metric name MLflow accepts: letters, digits, ``_-. /`` (others become ``_``), 250 characters."""
    return re.sub(r"[^\w.\- /]", "_", key)[:250]


def _mlflow_limit(name: str, default: int) -> int:
    try:
        from mlflow.utils import validation

        return int(getattr(validation, name, default))
    except ImportError:
        return default


# ------------------------------------------------------------------------------------------------- building
def _read_state(output_dir: str) -> dict[str, Any]:
    path = os.path.join(output_dir, TRACKERS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_state(output_dir: str, key: str, value: dict[str, Any]) -> None:
    state = {**_read_state(output_dir), key: value}
    text = json.dumps(state, indent=1)
    atomic_write(os.path.join(output_dir, TRACKERS_FILE), lambda f: f.write(text.encode()))


def param_value(value: Any) -> str:
    """A config value as an MLflow param: strings as they are, the rest as JSON (``null``, ``true``, ``[1, 2]``)."""
    return value if isinstance(value, str) else json.dumps(value)


def trackers_of(task: SSLTask) -> list[Tracker]:
    """The trackers among the sinks of the task's hooks (the log hook's, the kNN hook's), each once."""
    found: dict[int, Tracker] = {}
    for hook in task.hooks:
        for sink in getattr(hook, "sinks", None) or []:
            if isinstance(sink, Tracker):
                found[id(sink)] = sink
    return list(found.values())


def finish_trackers(task: SSLTask, error: BaseException | None = None, artifacts: bool = False) -> None:
    """End the task's tracker runs: FINISHED (with the report and plots as artifacts when ``artifacts``), KILLED
    after a pre-emption or Ctrl-C, FAILED after another ``error``."""
    status = run_status(error)
    for tracker in trackers_of(task):
        tracker.finish(status, task.output_dir if artifacts and error is None else None)
