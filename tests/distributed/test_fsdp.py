"""distributed.strategy=fsdp (FSDP2) on 2 gloo processes: it trains as DDP does, its teachers are sharded like
their students, its checkpoints (sharded folders or whole files) load anywhere, and what it cannot take is
refused."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from dist_workers import cli_main, run_ranks, strategy_runs
from helpers import RECIPES, REPO, SMALL, run_sslkit
from safetensors.torch import load_file

pytestmark = pytest.mark.multiprocess

STEPS = 10


CASES = {
    "dino_vit": [],
    "mae": [],
    "dinov2": ["optim.micro_batches=2"],  # 2 micro-batches per update: FSDP's gradient sync held off on the first
    "mae-bf16": ["amp.enabled=true", "amp.dtype=bfloat16"],
    # dinov3: timm's DINOv3 trunk (rotary position embeddings, registers, LayerScale 1e-5) and the Gram teacher
    # (sharded like the EMA teacher, a snapshot before update 1 and refreshed at every update up to 4), KoLeo off:
    # with LayerScale at 1e-5 every image's CLS feature is nearly the same at the start, and KoLeo's nearest
    # neighbour among such near-ties is decided by rounding (docs/vit.md)
    "dinov3": ["loss.koleo_weight=0"],
}


def test_fsdp_trains_like_ddp(tmp_path: Path) -> None:
    """10 updates of each recipe under ddp and under fsdp on the same 2 processes and data: every rank's loss at
    every micro-batch, and the weights after the last update, agree to float32 rounding. With 2 processes FSDP's
    reduce-scatter averages the same two numbers DDP's all-reduce does, so mae (no clipping) ends bit-identical;
    dino_vit and dinov2 clip the gradients, and the norm of sharded gradients is summed shard by shard, so the
    clip factor differs in the last bits and AdamW carries that on. Measured after 10 updates: max weight
    difference 0 (mae), 5.1e-7 (dinov2, 2 micro-batches per update), 1.2e-7 (dinov3: the DINOv3 trunk, the Gram
    teacher), 8.8e-6 (dino_vit); tolerance 5e-5, as for 1 against 2 processes under AdamW. Under bf16 FSDP gathers
    the parameters in bf16 where DDP's autocast casts them per operation (layer norms read them in float32), so the
    losses agree to bf16 rounding only (weights within 1.3e-4 after 10 updates, tolerance 5e-3); the sharded
    parameters stay float32."""
    ddp_runs = run_ranks(strategy_runs, 2, str(tmp_path / "ddp"), CASES, "ddp", STEPS, str(tmp_path / "d"))
    fsdp_runs = run_ranks(strategy_runs, 2, str(tmp_path / "fsdp"), CASES, "fsdp", STEPS, str(tmp_path / "f"))
    for case, extra in CASES.items():
        _compare(case, extra, [r[case] for r in ddp_runs], [r[case] for r in fsdp_runs])


def _compare(case: str, extra: list[str], ddp: list[dict[str, Any]], fsdp: list[dict[str, Any]]) -> None:
    recipe = case.split("-")[0]
    assert fsdp[0]["sharded"] == fsdp[0]["params"] > 0 and ddp[0]["sharded"] == 0
    assert fsdp[0]["dtypes"] == {torch.float32}
    bf16 = "amp.enabled=true" in extra
    micro = 2 if "optim.micro_batches=2" in extra else 1
    for rank in range(2):
        a, b = ddp[rank]["losses"], fsdp[rank]["losses"]
        assert a.shape == b.shape == (STEPS * micro,) and torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=2e-2 if bf16 else 1e-5, atol=1e-6)
    # the teachers (dinov3's Gram teacher too) are sharded as their student: same placements, same local shapes, so
    # the EMA step and the Gram snapshot are local
    layout = fsdp[0]["layout"]
    if recipe != "mae":
        assert layout and all(t and s and same and shape for t, s, same, shape in layout)
    whole_ddp, whole_fsdp = ddp[0]["model"], fsdp[0]["model"]
    assert whole_fsdp.keys() == whole_ddp.keys() and fsdp[1]["model"] == {}
    worst = max((whole_fsdp[k].double() - whole_ddp[k].double()).abs().max().item() for k in whole_ddp)
    print(f"{case}: max |fsdp - ddp| over the weights after {STEPS} updates: {worst:.2e}")
    assert worst < (5e-3 if bf16 else 5e-5), worst


#: dinov2 (teacher, Sinkhorn-Knopp, masks, drop path) under fsdp, 8 steps over 2 epochs, a checkpoint every 3.
RESUMED = ["config=dinov2", *SMALL, "optim.epochs=2", "data.train.kwargs.num_samples=128", "checkpoint.every_n_steps=3",
           "checkpoint.every_n_epochs=0", "checkpoint.keep_last=0", "eval.knn.enabled=false", "log.tensorboard=false",
           "imports=[sslkit_faults]", "distributed.strategy=fsdp"]
CRASH = "hooks=[{name: fault_crash, step: %d}]"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[list[str]], dict[str, Any]]:
    """The uninterrupted 2-process run's final state with the checkpoint options ``form``, each run once: the
    sharded form and its background writing (checkpoint.async_save) write the same folders, so they share one."""
    from reliability_helpers import RECIPE_ARGS, latest_state

    runs: dict[tuple[str, ...], dict[str, Any]] = {}

    def state(form: list[str]) -> dict[str, Any]:
        key = tuple(a for a in form if not a.startswith("checkpoint.async_save"))
        if key not in runs:
            tmp = tmp_path_factory.mktemp("fsdp_ref")
            args = [*RESUMED, *RECIPE_ARGS["dinov2"], *key, CRASH % 10**6, f"output_dir={tmp / 'ref'}"]
            assert run_ranks(cli_main, 2, str(tmp / "r"), args) == ["0", "0"]
            runs[key] = latest_state(tmp / "ref")
        return runs[key]

    return state


@pytest.mark.parametrize("form", ["sharded", "whole", "sharded-async"])
def test_fsdp_resumes_bit_identically_and_its_checkpoint_loads_anywhere(tmp_path: Path, form: str,
                                                                         uninterrupted: Callable[..., dict[str, Any]],
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """dinov2 on 2 processes under fsdp: a crash on both ranks after step 5 is resumed from step 3 and ends
    bit-identical to the uninterrupted run (weights, AdamW moments, every rank's RNG). The checkpoint (a folder each
    rank wrote its shards into, written in the background with checkpoint.async_save, or one gathered file) holds
    the model under the names a one-process run uses, and the optimizer state by parameter name: it resumes in one
    process (ddp or fsdp alike), and the export tool reads it into timm's ViT, strictly."""
    from reliability_helpers import RECIPE_ARGS, assert_identical, latest_state

    from sslkit.launch.cli import main

    options = {"sharded": [], "whole": ["checkpoint.sharded=false"], "sharded-async": ["checkpoint.async_save=true"]}
    args = [*RESUMED, *RECIPE_ARGS["dinov2"], *options[form]]
    out = tmp_path / "crashed"
    crashed = run_ranks(cli_main, 2, str(tmp_path / "c"), [*args, CRASH % 5, f"output_dir={out}"])
    assert all("injected crash after step 5" in c for c in crashed), crashed
    assert latest_state(out)["position"]["step"] == 3
    assert run_ranks(cli_main, 2, str(tmp_path / "c2"), [*args, CRASH % 5, f"output_dir={out}"]) == ["0", "0"]
    expected, got = uninterrupted(options[form]), latest_state(out)
    assert expected["position"]["step"] == 8
    assert_identical(got, expected)
    assert all(isinstance(name, str) for name in got["optimizer"]["state"])  # by parameter name
    names = sorted(p.name for p in (out / "checkpoints").iterdir())  # step 3 before the crash, 6 and 8 after
    if form == "whole":
        assert names == [f"checkpoint_{i:09d}.pt" for i in (3, 6, 8)] + ["latest.txt"], names
    else:
        assert names == [f"checkpoint_{i:09d}" for i in (3, 6, 8)] + ["latest.txt"], names
        folder = out / "checkpoints" / names[0]
        assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        sizes = [(folder / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
        assert 0.6 < sizes[1] / sizes[0] < 1.1, sizes  # each rank wrote its half (rank 0 also the run's record)
        from sslkit.checkpointing.sharded import _metadata

        storage = _metadata(str(folder)).storage_data  # each rank's own state (RNG) under its key, in its file
        files = {index.fqn: info.relative_path for index, info in storage.items()}
        assert (files["rank_state.0"], files["rank_state.1"], files["extra"]) == \
            ("__0_0.distcp", "__1_0.distcp", "__0_0.distcp"), files
        # a shard file lost (a node's part never copied over): said, with what to do, and nothing trained
        lost = tmp_path / "lost"
        shutil.copytree(out, lost)
        (lost / "checkpoints" / "checkpoint_000000008" / "__1_0.distcp").unlink()
        code = main([*args, "optim.epochs=3", "data.batch_size=32", "checkpoint.resume_changed_config=true",
                     CRASH % 10**6, f"output_dir={lost}"])
        err = capsys.readouterr().err
        assert code == 2 and "is missing __1_0.distcp" in err and "Traceback" not in err, err
        assert sorted(p.name for p in (lost / "checkpoints").iterdir()) == names
    # one process with the same global batch, as a longer run: the whole model, the named optimizer state, rank
    # 0's RNG (the changed batch per process is accepted explicitly)
    for strategy in ("fsdp", "ddp"):
        longer = tmp_path / f"one-{strategy}"
        shutil.copytree(out, longer)
        code = main([*args, "optim.epochs=3", "data.batch_size=32", "checkpoint.resume_changed_config=true",
                     f"distributed.strategy={strategy}", CRASH % 10**6, f"output_dir={longer}"])
        assert code == 0 and latest_state(longer)["position"]["step"] == 12
    exported = tmp_path / "encoder.safetensors"
    code, _, err = run_sslkit("export", f"checkpoint={out}", f"output={exported}")
    assert code == 0, err
    meta = json.loads((tmp_path / "encoder.json").read_text())
    timm.create_model(meta["timm_arch"], num_classes=0, **meta["timm_kwargs"]).load_state_dict(
        load_file(str(exported)), strict=True)


def test_fsdp_holds_half_the_state_and_checkpointing_keeps_fewer_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/memory.py's accounting on 2 processes: under fsdp each holds about half of the parameters,
    gradients and AdamW moments ddp holds (the shards are padded to whole rows per process), the same
    activations, and with model.activation_checkpointing only the blocks' inputs of them."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the spawned processes import it by name too
    memory = importlib.import_module("memory")
    small = ["config=dinov2", *SMALL, *RECIPES["dinov2"]]
    runs = [[*small, "distributed.strategy=ddp"], [*small, "distributed.strategy=fsdp"],
            [*small, "distributed.strategy=fsdp", "model.activation_checkpointing=true"]]
    ddp, fsdp, checkpointed = memory.run(runs, 2)
    for rank in range(2):
        for key in ("parameters", "gradients", "optimizer"):
            ratio = fsdp[rank][key] / ddp[rank][key]
            assert 0.45 < ratio < 0.6, (rank, key, ratio)
        assert fsdp[rank]["activations"] == ddp[rank]["activations"] > 0
        assert checkpointed[rank]["activations"] < 0.5 * fsdp[rank]["activations"], checkpointed[rank]
        assert {k: v for k, v in checkpointed[rank].items() if k != "activations"} == \
            {k: v for k, v in fsdp[rank].items() if k != "activations"}


@pytest.mark.parametrize("recipe", ["dinov2", "ijepa", "dinov3"])
def test_activation_checkpointing_changes_no_number(tmp_path: Path, recipe: str) -> None:
    """model.activation_checkpointing recomputes each block in backward from its saved input, with the RNG state
    of the forward (drop path draws the same): 3 updates end bit-identical to the run that kept everything, and
    the parameter names (checkpoint keys, lr groups) are the same. ``dinov3``: on timm's DINOv3 trunk, whose
    blocks also take the rotary embeddings, with the Gram teacher's forward."""
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    states = []
    for ac in ("false", "true"):
        cfg = compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe], "optim.max_steps=3",
                              "model.trunk_kwargs.drop_path_rate=0.1", "eval.knn.enabled=false",
                              "log.tensorboard=false", "checkpoint.every_n_epochs=0",
                              f"model.activation_checkpointing={ac}", f"output_dir={tmp_path / ac}"])
        (tmp_path / ac).mkdir()
        task = build_task(cfg)
        assert hasattr(task.base_model.trunk.blocks[0].forward, "__wrapped__") == (ac == "true")  # checkpointed
        try:
            train(task, standard_train_step)
        finally:
            task.close()
        states.append(task.base_model.state_dict())
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key
