"""Methods as objects: what each declares, required hooks that cannot be dropped, hooks added on the command line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import RECIPES, SMALL
from reliability_helpers import latest_state

import sslkit.methods  # noqa: F401  (registrations)
from sslkit import registry as R
from sslkit.config.compose import compose_config
from sslkit.launch.cli import main

QUICK = [*SMALL, "log.tensorboard=false", "eval.knn.enabled=false"]


def test_every_method_names_registered_parts_and_its_recipe_keeps_its_required_hooks() -> None:
    methods = dict(R.METHODS)
    assert set(methods) <= set(RECIPES)  # a recipe per method, named after it
    for recipe in set(RECIPES) - set(methods):  # the others (dino_vit, ...) train a registered method
        assert compose_config([f"config={recipe}", "machine.device=cpu"]).method.name in methods, recipe
    for name, method in methods.items():
        assert method.model in dict(R.MODELS) and method.loss in dict(R.LOSSES)
        assert method.transform in dict(R.TRANSFORMS)
        assert all(h in dict(R.HOOKS) for h in method.required_hooks)
        teacher = RECIPES["distill"] if name == "distill" else []  # (the recipe requires its teacher)
        cfg = compose_config([f"config={name}", "machine.device=cpu", *teacher])
        assert (cfg.model.name, cfg.loss.name, cfg.data.transform.name) == (method.model, method.loss, method.transform)
        assert set(method.required_hooks) <= set(cfg.method.hooks)
    assert (methods["mae"].masking, methods["mae"].patch_tokens) == ("random", True)
    assert all((methods[n].masking, methods[n].patch_tokens) == ("block", True) for n in ("ibot", "dinov2", "dinov3"))
    assert (methods["ijepa"].masking, methods["ijepa"].patch_tokens) == ("multi_block", True)
    assert all(m.masking is None for n, m in methods.items() if n not in ("mae", "ibot", "dinov2", "dinov3", "ijepa"))
    assert methods["byol"].required_hooks == ("momentum_teacher",)
    assert methods["dinov3"].required_hooks == ("momentum_teacher", "gram_teacher")
    assert methods["swav"].required_hooks == ("swav_prototypes",) and methods["swav"].transform == "multicrop"
    assert methods["dino"].accepted_keys() == {
        "model.kwargs": ["num_global"],
        "loss": ["out_dim", "student_temp", "teacher_temp", "warmup_teacher_temp", "warmup_teacher_temp_steps",
                 "center_momentum", "warmup_teacher_temp_epochs"]}


@pytest.mark.parametrize("drop", ["method.hooks.momentum_teacher=null", "method.hooks={}"])
def test_a_required_hook_cannot_be_dropped(tmp_path: Path, capsys: pytest.CaptureFixture[str], drop: str) -> None:
    """BYOL without its momentum teacher trained with a target that never moved, exit 0: now a config error."""
    code = main(["config=byol", *QUICK, drop, f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "method byol cannot train without the momentum_teacher hook" in err
    assert not (tmp_path / "run").exists()


def test_an_optional_hook_can_be_dropped_and_a_method_hook_is_not_added_twice(tmp_path: Path) -> None:
    cfg = compose_config(["config=byol", *QUICK, "method.hooks.collapse_monitor=null", f"output_dir={tmp_path}"])
    assert cfg.method.hooks.collapse_monitor is None
    with pytest.raises(ValueError, match=r"momentum_teacher is one of the method's hooks already"):
        compose_config(["config=byol", *QUICK, "hooks=[{name: momentum_teacher}]", f"output_dir={tmp_path}"])


def test_a_hook_added_on_the_command_line_keeps_the_recipes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The documented way to add a hook (hooks=[{name: ...}]) used to replace the recipe's list: BYOL's teacher
    then stayed identical from step 2 to 4. Now it is added, and the teacher moves."""
    out = tmp_path / "run"
    args = ["config=byol", *QUICK, *RECIPES["byol"], "optim.max_steps=4", "checkpoint.every_n_steps=2",
            "checkpoint.keep_last=0", "imports=[sslkit_faults]", "hooks=[{name: fault_crash, step: 1000}]",
            f"output_dir={out}"]
    assert main(args) == 0
    capsys.readouterr()
    ckpts = out / "checkpoints"
    at2 = torch.load(ckpts / "checkpoint_000000002.pt", weights_only=False)
    at4 = latest_state(out)
    assert at4["position"]["step"] == 4
    assert {"momentum_teacher", "collapse_monitor"} <= set(at4["hooks"])
    teacher = [k for k in at4["model"] if k.startswith("teacher_") and at4["model"][k].is_floating_point()]
    assert any(not torch.equal(at2["model"][k], at4["model"][k]) for k in teacher)


def test_a_method_carries_its_own_config_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method's rules (Method.rules) run in validation on the run's shape as plain values: a user's method adds
    its own without editing sslkit, and its message is a config error like sslkit's own."""
    from sslkit.config.schema import ConfigError
    from sslkit.methods.base import Method, RunShape

    seen: list[RunShape] = []

    def at_most_eight(shape: RunShape) -> list[str]:
        seen.append(shape)
        return [] if shape.batch_per_process <= 8 else [f"'data.batch_size' = {shape.batch_per_process}: mine "
                                                         "trains on at most 8 images per process"]

    mine = Method(name="mine", model="ssl_model", loss="nt_xent", transform="simclr", rules=(at_most_eight,))
    monkeypatch.setitem(R.METHODS._obj_map, "mine", mine)  # registered for this test only
    base = ["config=simclr", "method.name=mine", "machine.device=cpu", "distributed.nproc_per_node=2"]
    with pytest.raises(ConfigError, match=r"'data.batch_size' = 16: mine trains on at most 8 images per process"):
        compose_config([*base, "data.batch_size=16"])
    compose_config([*base, "data.batch_size=8"])
    assert seen[-1].processes == 2 and seen[-1].loss["temperature"] == pytest.approx(0.2)
    assert seen[-1].loss["name"] == "nt_xent" and isinstance(seen[-1].model_kwargs, dict)


def test_a_method_owns_its_sections_sees_them_in_its_rules_and_completes_the_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A key path a method declares its own (Method.sections) reaches its rules as plain values; set in a run of
    another method it is a config error naming the key and its reader; Method.complete fills what the method
    derives before validation. A user's method does all three without editing sslkit."""
    from sslkit.config.schema import ConfigError
    from sslkit.methods.base import Method, RunShape

    seen: list[RunShape] = []

    def ratios_sum_to_one(shape: RunShape) -> list[str]:
        seen.append(shape)
        ratios = shape.sections["hires.ratios"]
        return [] if not ratios or sum(ratios) == 1 else [f"'hires.ratios' = {ratios}: mine needs them to sum to 1"]

    def name_it(cfg: Any) -> None:
        if cfg.name == "named-by-mine":
            cfg.log.every_n_steps = 7

    mine = Method(name="mine", model="ssl_model", loss="nt_xent", transform="simclr", rules=(ratios_sum_to_one,),
                  sections=("hires.ratios",), complete=name_it)
    monkeypatch.setitem(R.METHODS._obj_map, "mine", mine)
    base = ["config=simclr", "machine.device=cpu"]
    with pytest.raises(ConfigError, match=re.escape("'hires.ratios' = [0.5, 0.2]: mine needs them to sum to 1")):
        compose_config([*base, "method.name=mine", "hires.ratios=[0.5,0.2]"])
    cfg = compose_config([*base, "method.name=mine", "hires.ratios=[0.5,0.5]", "name=named-by-mine"])
    assert seen[-1].sections == {"hires.ratios": [0.5, 0.5]} and seen[-1].trunk == cfg.model.trunk
    assert seen[-1].transform["name"] == "simclr" and cfg.log.every_n_steps == 7
    with pytest.raises(ConfigError, match=re.escape("'hires.ratios' is set, but method.name=simclr does not read it: "
                                                    "the hires.ratios keys are read by method.name=mine only")):
        compose_config([*base, "hires.ratios=[1.0]"])
    compose_config(base)  # left at its default, another method's section is no error


def test_the_config_layers_name_no_method() -> None:
    """Validation knows no method by name: each method's checks are its rules (Method.rules), its sections its own
    (Method.sections), so the modules of the config check hold none of the registered methods' names."""
    import sslkit.config.machine
    import sslkit.config.rules
    import sslkit.config.validate
    import sslkit.config.values

    names = [name for name, _ in R.METHODS]
    for module in (sslkit.config.validate, sslkit.config.values, sslkit.config.rules, sslkit.config.machine):
        text = Path(module.__file__).read_text()
        found = [n for n in names if re.search(rf"(?<![\w.]){n}(?![\w])", text)]
        assert not found, f"{module.__name__} names the methods {found}"
