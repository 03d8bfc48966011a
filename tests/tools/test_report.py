"""sslkit report: the summary of a run folder (figures computed here from the records) and its PNG plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from PIL import Image

from sslkit.config.compose import compose_config
from sslkit.launch.runfolder import write_command, write_config
from sslkit.tools.report import ReportError, main, summarize, write_report
from tests.helpers import SMALL, run_main

PNG = b"\x89PNG\r\n\x1a\n"


def _folder(tmp_path: Path, argv: list[str], torn: bool = False) -> tuple[Path, list[dict]]:
    """A run folder written by hand: config.yaml and command.json of ``argv``, metrics of a resumed run (steps
    20-30 logged twice), a kNN record and eval/linear.json."""
    out = tmp_path / "run"
    cfg = compose_config([*argv, f"output_dir={out}"])
    out.mkdir()
    write_config(cfg)
    write_command(str(out), argv)
    records = []
    for step in (10, 20, 30, 20, 30, 40):  # a resume from step 10 logs 20 and 30 again
        resumed = len(records) >= 3
        # each process counts elapsed_s from its own start: 20, 40, 60 s, then the resumed one 20, 40, 60 s
        elapsed = (step - 10) * 2.0 if resumed else step * 2.0
        records.append({"step": step, "epoch": 0, "phase": "train", "loss": 5.0 - step / 10 + (0.5 if resumed else 0),
                        "lr": 0.1 * step, "img_per_s": 100.0 + step + (7 if resumed else 0), "elapsed_s": elapsed,
                        "eta_s": 0.0 if step == 40 else 10.0, "rankme_features": 3.0 + step})
    records.append({"step": 40, "epoch": 0, "phase": "eval", "knn_top1": 0.71, "knn_top5": 0.95})
    text = "".join(json.dumps(r) + "\n" for r in records) + ('{"step": 50, "lo' if torn else "")
    (out / "metrics.jsonl").write_text(text)
    (out / "eval").mkdir()
    (out / "eval" / "linear.json").write_text(json.dumps({
        "top1": 0.8, "top5": 0.97, "step": 40, "done": True, "epochs_done": 2,
        "epochs": [{"epoch": 1, "top1": 0.75}, {"epoch": 2, "top1": 0.8}]}))
    (out / "eval" / "finetune.json").write_text(json.dumps({
        "top1": 0.86, "top5": 0.99, "step": 40, "done": True, "epochs_done": 3, "epochs": []}))
    return out, records


def test_summary_figures_match_the_records(tmp_path: Path) -> None:
    out, records = _folder(tmp_path, ["config=simclr", "data=synthetic", "optim.lr=0.7"], torn=True)
    info = summarize(str(out))
    train = [r for r in records if r["phase"] == "train"]
    assert info["median_img_per_s"] == pytest.approx(statistics.median(r["img_per_s"] for r in train))
    # the last 10% of 40 steps holds one logged value: step 40's 1.5 (resumed)
    assert info["final_loss"] == {"value": 1.5, "count": 1, "from_step": 40, "to_step": 40}
    # both processes' time: 60 s before the resume, 60 s after
    assert info["finished"] and info["steps"] == 40 and info["wall_s"] == pytest.approx(120.0) and info["parts"] == 2
    assert info["knn"]["top1"] == 0.71 and info["linear"]["top1"] == 0.8 and info["finetune"]["top1"] == 0.86
    assert info["monitors"]["rankme_features"] == 43.0
    assert info["recipe_diff"] == ["optim.lr: 0.3 -> 0.7"]

    text = write_report(str(out))
    assert (out / "report.md").read_text() == text
    for needle in ("finished at step 40", "final loss 1.5000 (logged at step 40)", "in 2 parts (resumed 1 time; "
                   "their sum)", "kNN top-1 0.7100", "linear probe top-1 0.8000",
                   "fine-tuning top-1 0.8600, top-5 0.9900 (step 40, eval/finetune.json, 3 epochs)",
                   "optim.lr: 0.3 -> 0.7", "![loss](plots/loss.png)"):
        assert needle in text
    for name in ("loss.png", "lr.png", "eval.png"):
        data = (out / "plots" / name).read_bytes()
        assert data.startswith(PNG)
        with Image.open(out / "plots" / name) as image:
            assert image.size[0] >= 300 and image.size[1] >= 200


def test_the_final_loss_is_the_end_of_the_run_not_its_last_five_records() -> None:
    """A 100-step run logged every step: the mean of steps 90-100 (11 values); a short run logged at steps 2, 4, 6
    (MAE's 0.848 of issue 34 averaged back to its start): its last value only."""
    from sslkit.tools.report import final_loss, training_time

    losses = [(step, 1000.0 - step) for step in range(1, 101)]
    assert final_loss(losses, 100) == {"value": pytest.approx(905.0), "count": 11, "from_step": 90, "to_step": 100}
    assert final_loss([(2, 0.95), (4, 0.85), (6, 0.75)], 6)["value"] == 0.75
    assert final_loss([], 0) is None
    # one process: its last elapsed_s; three (two resumes, one right after the other): the sum of each one's last
    assert training_time([{"elapsed_s": 5.0}, {"elapsed_s": 9.0}]) == (9.0, 1)
    assert training_time([{"elapsed_s": 73.0}, {"elapsed_s": 4.0}, {"elapsed_s": 58.0}, {"elapsed_s": 1.0}]) == \
        (132.0, 3)
    assert training_time([{"step": 1}]) == (None, 0)


def test_a_run_without_command_json_or_evaluations(tmp_path: Path) -> None:
    out, _ = _folder(tmp_path, ["config=simclr", "data=synthetic"])
    (out / "command.json").unlink()
    (out / "eval" / "linear.json").unlink()
    text = write_report(str(out))
    assert "command that started the run is unknown" in text and "linear probe: not run" in text


def test_wrong_folders_are_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ReportError, match="no such folder"):
        summarize(str(tmp_path / "missing"))
    assert main([str(tmp_path)]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err


def test_a_finished_run_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "real"
    proc = run_main("config=simclr", *SMALL, "optim.max_steps=2", "log.tensorboard=false", "optim.lr=0.2",
                    "log.report=true", f"output_dir={out}")
    assert "summary and plots" in proc.stdout
    text = (out / "report.md").read_text()
    assert "finished at step 2" in text and "optim.lr: 0.3 -> 0.2" in text and "kNN top-1" in text
    assert "log.report" not in text  # SMALL turns it off, this run on: as its recipe
    assert (out / "plots" / "loss.png").read_bytes().startswith(PNG)


def test_a_knn_curve_on_a_fixed_subsample_every_epoch_apart_from_the_final_knn(tmp_path: Path) -> None:
    """eval.knn.every_n_epochs=1 with eval.knn.subsample=20: one knn_curve_top1 per epoch, on 20 samples of each
    split drawn once by the seed, with k scaled to the smaller memory; the last point (the final weights) is the
    weighted kNN of those samples' features as sslkit extract gives them; the final knn_top1 uses every sample with
    eval.knn.k; the report draws both."""
    import numpy as np
    import torch

    from sslkit.builder import knn_subsample
    from sslkit.evaluation import weighted_knn
    from tests.helpers import metrics, run_sslkit

    out = tmp_path / "curve"
    run_main("config=simclr", *SMALL, "optim.epochs=3", "log.tensorboard=false", "eval.knn.every_n_epochs=1",
             "eval.knn.subsample=20", "data.test.kwargs={num_samples: 48}", "log.report=true", f"output_dir={out}")
    records = metrics(out)
    curve = [r for r in records if "knn_curve_top1" in r]
    final = [r for r in records if "knn_top1" in r]
    assert [(r["epoch"], r["step"]) for r in curve] == [(0, 4), (1, 8), (2, 12)]
    assert len(final) == 1 and final[0]["step"] == 12 and "knn_top1" not in curve[-1]
    feats = {}
    for split in ("train", "test"):
        code, _, err = run_sslkit("extract", f"checkpoint={out}", f"split={split}", f"output={tmp_path / split}.npz")
        assert code == 0, err
        data = np.load(tmp_path / f"{split}.npz")
        feats[split] = (torch.from_numpy(data["features"]), torch.from_numpy(data["labels"]))
    seed = 0  # the recipe's seed; the train split's draw uses it, the test split's seed + 1
    picked = {split: torch.randperm(len(feats[split][0]), generator=torch.Generator().manual_seed(seed + i))[:20]
              for i, split in enumerate(("train", "test"))}
    sub = {split: (f[picked[split]], y[picked[split]]) for split, (f, y) in feats.items()}
    # k scaled to the memory: eval.knn.k=5 on 20 of the 64 train samples -> round(5 * 20 / 64) = 2
    expected = weighted_knn(*sub["train"], *sub["test"], num_classes=10, k=2, temperature=0.1)
    assert curve[-1]["knn_curve_top1"] == pytest.approx(expected["knn_top1"], abs=1e-9)
    whole = weighted_knn(*feats["train"], *feats["test"], num_classes=10, k=5, temperature=0.1)
    assert final[0]["knn_top1"] == pytest.approx(whole["knn_top1"], abs=1e-9)
    text = (out / "report.md").read_text()
    assert "kNN curve (3 points)" in text and (out / "plots" / "eval.png").read_bytes().startswith(PNG)
    assert knn_subsample("auto", torch.device("cpu")) == 5000 and knn_subsample("auto", torch.device("cuda")) == 0
    assert knn_subsample(500, torch.device("cuda")) == 500
