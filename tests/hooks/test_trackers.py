"""W&B and MLflow trackers (sslkit/hooks/trackers.py) in real in-process runs: what they hold is what metrics.jsonl
holds, across a pre-emption or a crash and the resume; a missing or failing tracker never costs the training run."""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import SMALL, metrics, run_main
from reliability_helpers import hooks_override

from sslkit.errors import PREEMPTED_EXIT_CODE

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

#: 32 synthetic images in batches of 8: 4 steps per epoch, 6 steps, a checkpoint at each epoch end; every step
#: logged, the kNN evaluation at the end, the report and its plots.
ARGS = ["config=simclr", *SMALL, "data.train.kwargs.num_samples=32", "data.batch_size=8", "optim.max_steps=6",
        "log.every_n_steps=1", "eval.knn.enabled=true",
        "log.tensorboard=false", "log.report=true", "imports=[sslkit_faults]", "checkpoint.keep_last=0",
        "log.wandb.enabled=true", "log.wandb.tags=[ci,trackers]", "log.mlflow.enabled=true",
        "log.mlflow.tags={team: ssl}"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A working folder (the default ./mlruns store lands there) and a W&B that cannot reach any server: no API
    key, no netrc, its folders in here, its server a closed local port."""
    root = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "MLFLOW_TRACKING_URI"):
            mp.delenv(name, raising=False)
        mp.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
        mp.setenv("NETRC", str(root / "no-netrc"))
        for name, folder in (("WANDB_DIR", "wandb"), ("WANDB_CACHE_DIR", "wandb-cache"),
                             ("WANDB_CONFIG_DIR", "wandb-config"), ("WANDB_DATA_DIR", "wandb-data")):
            mp.setenv(name, str(root / folder))
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "")
        mp.delenv("MLFLOW_ALLOW_FILE_STORE")  # the tracker sets it for its file store; put back as it was after
        yield root
    import wandb

    wandb.teardown()  # wandb's service process


@dataclass
class Resumed:
    """A run stopped part-way, then run again with the same command."""

    out: Path
    first_exit: int | str
    first_ids: dict[str, Any]
    status_after_first: str
    second_stdout: str


def _stopped_and_resumed(root: Path, name: str, fault: dict[str, Any]) -> Resumed:
    from mlflow.tracking import MlflowClient

    out = root / name
    args = [*ARGS, hooks_override("simclr", fault), f"output_dir={out}"]
    try:
        first: int | str = run_main(*args, check=False).returncode
    except RuntimeError as exc:  # an injected crash: a bug, not a user's error, so main raises it
        first = str(exc)
    ids = json.loads((out / "trackers.json").read_text())
    status = MlflowClient(ids["mlflow"]["tracking_uri"]).get_run(ids["mlflow"]["run_id"]).info.status
    second = run_main(*args)  # the fault fires in a fresh run only
    return Resumed(out, first, ids, status, second.stdout)


@pytest.fixture(scope="module")
def preempted(root: Path) -> Resumed:
    """SIGUSR1 after step 5: checkpoint at step 5, exit 75; the resumed run logs step 6 and the kNN."""
    return _stopped_and_resumed(root, "preempted", {"name": "fault_signal", "step": 5, "signal": "SIGUSR1"})


@pytest.fixture(scope="module")
def crashed(root: Path) -> Resumed:
    """An exception after step 6: the checkpoint of step 4 is the last, so the resumed run logs steps 5-6 again."""
    return _stopped_and_resumed(root, "crashed", {"name": "fault_crash", "step": 6})


SCENARIOS = ["preempted", "crashed"]


def _client(run: Resumed) -> tuple[Any, str]:
    from mlflow.tracking import MlflowClient

    ids = json.loads((run.out / "trackers.json").read_text())["mlflow"]
    return MlflowClient(ids["tracking_uri"]), ids["run_id"]


def _expected(out: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as ``{"<phase>/<field>": {step: value}}`` (the last value of a step, as a reader takes it)."""
    found: dict[str, dict[int, float]] = {}
    for record in metrics(out):
        if record.get("phase") == "warning":
            continue
        for key, value in record.items():
            if key not in ("step", "phase") and isinstance(value, int | float) and not isinstance(value, bool):
                found.setdefault(f"{record['phase']}/{key}", {})[record["step"]] = float(value)
    return found


# ------------------------------------------------------------------------------------------------- MLflow
def test_mlflow_holds_exactly_the_metrics_of_metrics_jsonl(preempted: Resumed, crashed: Resumed) -> None:
    for run in (preempted, crashed):
        client, run_id = _client(run)
        expected = _expected(run.out)
        assert {"train/loss", "train/lr", "eval/knn_top1"} <= set(expected)
        assert set(client.get_run(run_id).data.metrics) == set(expected)
        for key, by_step in expected.items():
            history = client.get_metric_history(run_id, key)
            held: dict[int, float] = {}
            for m in sorted(history, key=lambda m: m.timestamp):  # (stable: logging order within a millisecond)
                held[m.step] = m.value
            assert held == by_step, key
    # the crashed run logged steps 5 and 6 before the crash and again after the resume: both are kept, the last wins
    client, run_id = _client(crashed)
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == [1, 2, 3, 4, 5, 5, 6, 6]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_one_mlflow_run_across_the_resume_with_its_status(scenario: str, request: pytest.FixtureRequest) -> None:
    run: Resumed = request.getfixturevalue(scenario)
    assert run.first_exit == (PREEMPTED_EXIT_CODE if scenario == "preempted" else "injected crash after step 6")
    assert run.status_after_first == ("KILLED" if scenario == "preempted" else "FAILED")
    client, run_id = _client(run)
    assert run_id == run.first_ids["mlflow"]["run_id"]
    assert "(continued)" in run.second_stdout
    info = client.get_run(run_id).info
    assert info.status == "FINISHED" and info.run_name == "simclr-synthetic"  # the config's name
    # the default store: MLflow's own, a SQLite database in the working folder (no file store, which MLflow 3
    # refuses unless MLFLOW_ALLOW_FILE_STORE is set), one run per run folder in the experiment
    assert run.first_ids["mlflow"]["tracking_uri"] == f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ and not (Path.cwd() / "mlruns" / "0" / "meta.yaml").exists()
    experiment = client.get_experiment(info.experiment_id)
    assert experiment.name == "sslkit"
    names = {r.info.run_id for r in client.search_runs([info.experiment_id])}
    assert run_id in names


def test_mlflow_ui_started_in_the_working_folder_opens_the_default_store(preempted: Resumed) -> None:
    """docs/report.md's ``mlflow ui``, run where training started: its store is MLflow's default tracking URI, which
    resolves (no MLFLOW_TRACKING_URI set, no ./mlruns file store there) to the database the run wrote."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = mlflow.get_tracking_uri()  # sqlite:///mlflow.db, which MLflow may give as an absolute path
    assert uri.startswith("sqlite:///") and Path(uri.removeprefix("sqlite:///")).resolve() == Path.cwd() / "mlflow.db"
    run_id = preempted.first_ids["mlflow"]["run_id"]
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"


def test_a_file_store_still_works_when_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``log.mlflow.tracking_uri=file:...``: MLflow 3 opens it only with MLFLOW_ALLOW_FILE_STORE, which the tracker
    sets for its process; the run and its numbers are there."""
    from mlflow.tracking import MlflowClient

    from sslkit.hooks.trackers import MlflowTracker

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = (tmp_path / "store").as_uri()
    tracker = MlflowTracker(str(tmp_path), tracking_uri=store, experiment="files", run_name="r", tags={},
                            params={"optim.lr": "0.1"}, resume=False)
    tracker.write({"phase": "train", "step": 3, "loss": 1.5})
    tracker.finish("FINISHED")
    assert tracker.active and os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    run = MlflowClient(store).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"train/loss": 1.5}
    assert run.data.params == {"optim.lr": "0.1"}


def test_mlflow_params_hold_the_config_and_tags_and_artifacts(preempted: Resumed) -> None:
    client, run_id = _client(preempted)
    data = client.get_run(run_id).data
    params = data.params
    assert params["optim.max_steps"] == "6"
    assert params["data.batch_size"] == "8"
    assert params["method.name"] == "simclr"
    assert params["log.wandb.tags"] == '["ci", "trackers"]'
    assert params["model.trunk_kwargs.width"] == "8"
    assert params["output_dir"] == str(preempted.out)
    assert len(params) > 100  # more than one log_batch call's worth
    assert data.tags["team"] == "ssl"
    top = {a.path for a in client.list_artifacts(run_id)}
    plots = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert "report.md" in top
    assert plots == {f"plots/{p.name}" for p in (preempted.out / "plots").glob("*.png")} and plots


# ------------------------------------------------------------------------------------------------- W&B
def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file (a LevelDB-style log of protobuf ``Record``s: wandb 0.31 has no reader of
    its own in Python any more)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_wandb_offline_run_continues_and_holds_the_metrics(scenario: str, request: pytest.FixtureRequest) -> None:
    run: Resumed = request.getfixturevalue(scenario)
    run_id = run.first_ids["wandb"]["id"]
    assert json.loads((run.out / "trackers.json").read_text())["wandb"]["id"] == run_id
    # the first start and the resume: one W&B run id (a resume within the same second gets wandb's suffix "-1")
    folders = sorted((run.out / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(folders) == 2
    assert "wandb sync" in run.second_stdout
    held: dict[str, dict[int, float]] = {}
    for folder in folders:
        (log,) = folder.glob("*.wandb")
        for record in _wandb_records(log):
            if record.HasField("run"):
                assert record.run.run_id == run_id and list(record.run.tags) == ["ci", "trackers"]
            if record.HasField("history"):
                # ("train/loss" is stored as the nested key ["train", "loss"])
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                for key, value in row.items():
                    if "/" in key:
                        held.setdefault(key, {})[row["step"]] = value
    assert held == _expected(run.out)  # the steps logged twice kept (no step= for W&B to refuse), the last wins
    assert (folders[-1] / "files" / "report.md").exists()
    first, last = (list(_wandb_records(next(f.glob("*.wandb")))) for f in (folders[0], folders[-1]))
    assert any(r.HasField("preempting") for r in first) == (scenario == "preempted")
    assert [r.exit.exit_code for r in first if r.HasField("exit")] == [1]
    assert [r.exit.exit_code for r in last if r.HasField("exit")] == [0]
    (config,) = [r.run.config for r in last if r.HasField("run")]
    optim = {item.key: json.loads(item.value_json) for item in config.update}["optim"]
    assert optim["max_steps"] == 6  # the resolved config


def test_wandb_auto_mode_is_offline_without_a_key_or_a_server(root: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    import wandb

    from sslkit.hooks.trackers import WandbTracker

    tracker = WandbTracker.__new__(WandbTracker)
    tracker._wandb = wandb
    assert tracker._resolve_mode("auto") == "offline"  # no key (no WANDB_API_KEY, netrc or wandb settings)
    assert tracker._resolve_mode("online") == "offline"
    assert "mode=online but no API key" in caplog.text
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    caplog.clear()
    assert tracker._resolve_mode("auto") == "offline"  # a key, but the server does not answer
    assert tracker._resolve_mode("online") == "offline"
    assert "cannot be reached" in caplog.text and "127.0.0.1:9" in caplog.text
    assert tracker._resolve_mode("offline") == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert tracker._resolve_mode("auto") == "disabled"


# ------------------------------------------------------------------------------------------------- failures
def test_missing_trackers_cost_a_warning_and_the_run_goes_on(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    out = root / "missing"
    proc = run_main(*ARGS, "log.report=false", "eval.knn.enabled=false", f"output_dir={out}")
    log = (out / "log.txt").read_text()
    for extra in ("wandb", "mlflow"):
        assert f"pip install 'sslkit[{extra}]'" in proc.stdout and f"pip install 'sslkit[{extra}]'" in log
    assert [r["step"] for r in metrics(out) if r["phase"] == "train"] == list(range(1, 7))
    assert not (out / "trackers.json").exists()


def test_a_tracker_failing_mid_run_costs_one_warning(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient
    from wandb.sdk.wandb_run import Run

    calls = {"mlflow": 0, "wandb": 0}
    log_batch, log = MlflowClient.log_batch, Run.log

    def full_disk(self: Any, run_id: str, metrics: Any = (), **kwargs: Any) -> Any:
        if metrics:
            calls["mlflow"] += 1
            if calls["mlflow"] > 3:
                raise OSError(28, "No space left on device")
        return log_batch(self, run_id, metrics=metrics, **kwargs)

    def server_gone(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["wandb"] += 1
        if calls["wandb"] > 2:
            raise ConnectionError("the W&B server went away")
        return log(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", full_disk)
    monkeypatch.setattr(Run, "log", server_gone)
    out = root / "failing"
    proc = run_main(*ARGS, "log.report=false", f"output_dir={out}")
    warnings = [line for line in (out / "log.txt").read_text().splitlines() if " WARNING " in line]
    assert len([w for w in warnings if "MLflow failed" in w]) == 1
    assert "No space left on device" in proc.stdout
    assert len([w for w in warnings if "W&B failed" in w]) == 1
    assert calls == {"mlflow": 4, "wandb": 3}  # each switched off after its first error
    records = metrics(out)
    assert [r["step"] for r in records if r["phase"] == "train"] == list(range(1, 7))
    assert any("knn_top1" in r for r in records)
    assert (out / "checkpoints" / "checkpoint_000000006.pt").exists()
    client, run_id = _client(Resumed(out, 0, {}, "", ""))
    assert client.get_run(run_id).info.status == "FAILED"  # its record of the run is incomplete


def test_a_typo_in_a_tracker_key_is_refused_before_anything_starts(root: Path) -> None:
    out = root / "typo"
    proc = run_main("config=simclr", "log.wandb.projetc=x", f"output_dir={out}", check=False)
    assert proc.returncode == 2
    assert "unknown config key 'log.wandb.projetc'. Did you mean 'log.wandb.project'?" in proc.stderr
    assert not out.exists()
