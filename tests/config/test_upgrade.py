"""A run trained before keys were renamed is still read by the tools (its checkpoint's config made today's)."""

from __future__ import annotations

from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from sslkit.builder.runs import eval_config
from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.config.upgrade import upgrade_saved

#: docs/configs.md's "Renamed keys" table read backwards: today's last part of a key -> the one it had before.
BEFORE = {"start_step": "start_update", "ramp_steps": "ramp_updates",
          "warmup_teacher_temp_steps": "warmup_teacher_temp_iters",
          "freeze_prototypes_steps": "freeze_prototypes_iters", "queue_start_step": "queue_start_iter",
          "micro_batches": "accumulate_steps"}


def _as_before(node: Any) -> Any:
    """A resolved config tree with every key under the name it had before the rename (any section; the end of a
    longer name too: ``gram_start_step``), and ``model.freeze`` entries' ``steps`` as ``updates``."""
    if isinstance(node, list):
        return [_as_before(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        for new, old in BEFORE.items():
            if key == new or key.endswith(f"_{new}"):
                key = key[: len(key) - len(new)] + old
                break
        out[key] = _as_before(value)
    return out


def _saved(recipe: str, *overrides: str) -> DictConfig:
    """The config a run of ``recipe`` saves today (resolved, as config.yaml holds it)."""
    cfg = compose_config([f"config={recipe}", *overrides])
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.parametrize("recipe", ["dinov3", "swav", "dino"])
def test_a_config_saved_before_the_rename_reads_as_todays(recipe: str) -> None:
    """dinov3 (gram.*, hires.*, the loss's gram_* and warmup arguments, the Gram hook), swav (prototypes' freeze,
    queue start), dino (its warm-up); optim.micro_batches and a freeze entry in each: the old names give the config
    the new ones give, every key and value."""
    today = _saved(recipe, "optim.micro_batches=2", "model.freeze=[{params: 'trunk.*', steps: 3}]")
    before = OmegaConf.create(_as_before(OmegaConf.to_container(today)))
    before.model.freeze[0] = {"params": "trunk.*", "updates": 3}
    assert OmegaConf.to_container(before) != OmegaConf.to_container(today)
    upgraded, moved = upgrade_saved(before)
    assert "optim.accumulate_steps" in moved and "model.freeze[0].updates" in moved
    if recipe == "dinov3":
        assert {"gram.start_update", "gram.ramp_updates", "loss.gram_start_update", "hires.start_update"} <= set(moved)
    assert OmegaConf.to_container(upgraded) == OmegaConf.to_container(today)
    read = OmegaConf.to_container(eval_config(before, []))
    assert read == OmegaConf.to_container(eval_config(today, []))


def test_an_old_name_beside_its_new_one_is_left_for_validation_to_name() -> None:
    """Both names, perhaps with different values: nothing moved, and reading the run says which key to drop."""
    saved = _saved("dinov3")
    saved.gram.start_update = 7
    upgraded, moved = upgrade_saved(saved)
    assert moved == [] and upgraded.gram.start_update == 7
    with pytest.raises(ConfigError, match=r"gram\.start_update.*renamed 'gram\.start_step'"):
        eval_config(saved, [])


def test_a_checkpoint_written_before_the_rename_is_evaluated_and_exported(tmp_path) -> None:
    """A run's checkpoint as sslkit wrote it before the counters' rename (``position.update``, the config's
    ``optim.accumulate_steps``): the tools read its model, config and step; the export writes its trunk."""
    import torch
    import yaml
    from helpers import SMALL, run_main

    from sslkit.tools.export import export_main
    from sslkit.tools.pretrained import load_pretrained

    out = tmp_path / "run"
    run_main("config=simclr", *SMALL, "optim.max_steps=2", "eval.knn.enabled=false", "log.tensorboard=false",
             f"output_dir={out}")
    path = out / "checkpoints" / "checkpoint_000000002.pt"
    state = torch.load(path, weights_only=True)
    state["position"]["update"] = state["position"].pop("step")
    config = yaml.safe_load(state["config"])
    config["optim"]["accumulate_steps"] = config["optim"].pop("micro_batches")
    state["config"] = yaml.safe_dump(config)
    torch.save(state, path)
    loaded = load_pretrained(str(out), ["machine.device=cpu"])
    assert loaded.step == 2 and loaded.config.optim.micro_batches == 1
    assert export_main([f"checkpoint={out}", "twin=none", f"output={tmp_path / 'trunk.safetensors'}"]) == 0
