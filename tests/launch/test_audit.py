"""The CPU audit finds what breaks or stalls a step on CUDA, and no recipe's step has any of it."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import forkrun
import pytest
import torch
from helpers import HANG_S, RECIPES, SMALL

from sslkit.config.schema import ConfigError
from sslkit.launch.audit import StepAudit, audit_recipe

PLANTED = '''
import torch
import torch.nn.functional as F


def step(x):
    a = torch.zeros(3)                                   # 6: no device
    b = torch.zeros(3, device=x.device)                  # fine
    c = torch.zeros(3, device="cpu")                     # fine: the CPU is meant
    d = x.new_zeros(3) + torch.zeros_like(x[:3, 0])      # fine
    v = x.sum().item()                                   # 10: sync
    idx = torch.arange(2, device=x.device)
    y = x.clone()
    y[idx, idx] = float("-inf")                          # 13: sync (the number is copied to the GPU)
    y = y.masked_fill(y > 0, 0.0)                        # fine
    z = x[x > 0]                                         # 15: sync (boolean mask)
    if x.sum() > 0:                                      # 16: sync (branch on a tensor)
        pass
    w = F.adaptive_avg_pool2d(x[None, None].requires_grad_(), 3)
    w.sum().backward()                                   # 19: nondeterministic backward on CUDA
    return a, b, c, d, v, z
'''


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("planted_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_audit_finds_each_planted_fault_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "planted_step.py"
    path.write_text(textwrap.dedent(PLANTED).lstrip("\n"))
    module = _load(path)
    with StepAudit([str(tmp_path)]) as audit:
        module.step(torch.randn(5, 5))
    found = {(f.kind, f.call, int(f.where.split(":")[1].split()[0])) for f in audit.findings}
    assert ("no-device", "torch.zeros", 6) in found
    assert ("host-sync", "Tensor.item", 10) in found
    assert ("host-sync", "Tensor.__setitem__", 13) in found
    assert ("host-sync", "Tensor.__getitem__", 15) in found
    assert ("host-sync", "Tensor.__bool__", 16) in found
    assert ("nondeterministic", "aten._adaptive_avg_pool2d_backward", 19) in found
    flagged_lines = {line for _, _, line in found}
    assert not flagged_lines & {7, 8, 9, 11, 12, 14}, audit.findings  # the right ways are not flagged
    assert all("planted_step.py:" in f.where for f in audit.findings)


def test_calls_outside_the_roots_are_not_recorded(tmp_path: Path) -> None:
    path = tmp_path / "planted_step.py"
    path.write_text(textwrap.dedent(PLANTED).lstrip("\n"))
    module = _load(path)
    with StepAudit([str(tmp_path / "elsewhere")]) as audit:
        module.step(torch.randn(5, 5))
        torch.zeros(2).sum().item()  # this test file is no root either
    assert [f.kind for f in audit.findings] == ["nondeterministic"]  # op-level: found wherever it runs


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_no_recipe_step_makes_cpu_tensors_syncs_or_nondeterministic_calls(recipe: str) -> None:
    """Three real steps of every recipe (forward, loss, backward, update and the method's hooks): nothing a
    GPU would trip on. This is the CPU test behind 'every recipe runs on CUDA' (tests/gpu runs them there)."""
    findings = audit_recipe([f"config={recipe}", *SMALL, *RECIPES[recipe]])
    assert findings == [], "\n".join(map(str, findings))


@pytest.mark.slow
def test_amp_and_accumulation_steps_are_clean_too() -> None:
    findings = audit_recipe(["config=swav", *SMALL, *RECIPES["swav"], "amp.enabled=true", "optim.micro_batches=2",
                             "data.batch_size=8"])
    assert findings == [], "\n".join(map(str, findings))


@pytest.mark.parametrize("recipe", ["simclr", "dino"])
def test_the_batch_augmented_on_the_device_is_clean_too(recipe: str) -> None:
    """data.augment_on=device: the augmentation runs inside the step, so it too must make no CPU tensor, sync or
    nondeterministic call (it found the normalisation constants made without a device)."""
    findings = audit_recipe([f"config={recipe}", *SMALL, *RECIPES[recipe], "data.augment_on=device"])
    assert findings == [], "\n".join(map(str, findings))


#: timm's DINOv3 trunk (rotary position embeddings) in place of the recipe's ViT
ROPE = ["model.trunk=vit_small_patch16_dinov3", "+model.trunk_kwargs.depth=2"]


@pytest.mark.parametrize("recipe", ["dinov2", "mae"])
def test_the_dinov3_trunk_steps_are_clean_too(recipe: str, tmp_path: Path) -> None:
    """The RoPE trunk under a masked recipe (dinov2: the mask token; mae: the kept patches and their rotary
    embeddings gathered): no CPU tensor, sync or nondeterministic call in the step, and no tensor kept outside
    the module state (timm builds the rotary coordinates on the CPU; on CUDA the trunk computes the embedding on a
    host copy of its RoPE module and sends it from pinned memory: tests/gpu/test_vit_cuda.py)."""
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config

    findings = audit_recipe([f"config={recipe}", *SMALL, *RECIPES[recipe], *ROPE])
    assert findings == [], "\n".join(map(str, findings))
    task = build_task(compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe], *ROPE, "eval.knn.enabled=false",
                                      f"output_dir={tmp_path}"]))
    loose = [f"{name}.{attr}" for name, module in task.base_model.named_modules()
             for attr, value in vars(module).items() if isinstance(value, torch.Tensor)]
    assert loose == []


def test_a_stage_that_starts_after_the_audits_steps_is_audited_from_the_first() -> None:
    """config=dinov3 as printed starts its Gram loss at step 156, after the audit's 3 steps: the audit starts it at
    the first step (it stopped with a config error before), and a gram.start_step the command gives is kept."""
    small = [o for o in RECIPES["dinov3"] if not o.startswith("gram.start_step=")]
    assert audit_recipe(["config=dinov3", *SMALL, *small]) == []
    with pytest.raises(ConfigError, match=r"'gram.start_step' = 5 is after the run's end"):
        audit_recipe(["config=dinov3", *SMALL, *small, "gram.start_step=5"])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_module_state_is_registered_so_it_moves_with_the_model(recipe: str, tmp_path: Path) -> None:
    """A tensor kept as a plain attribute of a module stays on the CPU when the model goes to the GPU (and is not
    checkpointed): every tensor a model or loss holds must be a parameter or a buffer."""
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config

    task = build_task(compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe], "eval.knn.enabled=false",
                                      f"output_dir={tmp_path}"]))
    loose = [f"{part}.{name}.{attr}" for part, root in (("model", task.base_model), ("loss", task.loss))
             for name, module in root.named_modules() for attr, value in vars(module).items()
             if isinstance(value, torch.Tensor)]
    assert loose == []
    moved = [t.device.type for t in (*task.base_model.state_dict().values(), *task.loss.state_dict().values())
             if isinstance(t, torch.Tensor)]
    assert set(moved) == {"cpu"}


BAD_LOSS = '''
import torch
from sslkit.registry import register_loss


@register_loss("cpu_scale_loss")
class CpuScaleLoss(torch.nn.Module):
    def __init__(self, temperature: float = 0.1) -> None:
        super().__init__()

    def forward(self, output, sample, ctx=None):
        z = output["projections"][0]
        scale = torch.tensor(2.0)
        return (z * scale).pow(2).mean() + 0 * z.sum().item()
'''


@pytest.mark.slow
def test_tools_audit_names_a_user_method_s_faults_and_exits_1(tmp_path: Path) -> None:
    import os
    import sys

    from helpers import REPO

    (tmp_path / "my_ssl.py").write_text(BAD_LOSS.lstrip("\n"))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    base = [sys.executable, str(REPO / "tools" / "audit.py"), "config=simclr", *SMALL]
    bad = forkrun.run([*base, "imports=[my_ssl]", "loss.name=cpu_scale_loss"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=HANG_S)
    assert bad.returncode == 1, bad.stderr
    assert "my_ssl.py:12 in forward: torch.tensor [no-device]" in bad.stdout
    assert "my_ssl.py:13 in forward: Tensor.item [host-sync]" in bad.stdout
    good = forkrun.run(base, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=HANG_S)
    assert good.returncode == 0 and "0 finding(s)" in good.stdout
