"""On CUDA: the same masks as on the CPU, fused attention kernels in bf16, deterministic runs of the ViT recipes.

Marked ``gpu``: skipped where no CUDA device is visible (CI); ``python -m pytest -q -m gpu`` on a GPU machine.
Every recipe, the ViT ones included, also trains for 3 bf16 steps in tests/gpu/test_cuda.py. The CPU checks of the
same properties: tests/models/test_masking.py, tests/models/test_vit.py, tests/launch/test_audit.py.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from helpers import MAE_VIT_S16_224, RECIPES, SMALL, ade_folder, metrics, run_cli, run_main
from reliability_helpers import BASE, FAULT_ENV, RECIPE_ARGS, assert_identical, hooks_override, latest_state

from sslkit.models.masking import BlockMasking, MultiBlockMasking, RandomMasking, SampleKeys
from sslkit.models.vit import build_vit

pytestmark = [pytest.mark.gpu]

GPU = ["machine.device=cuda", "amp.enabled=true", "amp.dtype=bfloat16"]


@pytest.mark.parametrize("generator", [RandomMasking(0.75), BlockMasking(), MultiBlockMasking()])
def test_masks_are_the_same_on_the_gpu_as_on_the_cpu(generator) -> None:
    """Integer hashing on the device: the masks of a sample do not depend on where they are drawn."""
    index = torch.arange(1000, 1512)
    cpu = generator(SampleKeys(0, 3, index, 1), (14, 14))
    gpu = generator(SampleKeys(0, 3, index.cuda(), 1), (14, 14))
    assert gpu.mask.device.type == "cuda"
    assert torch.equal(cpu.mask, gpu.mask.cpu())
    if cpu.keep is not None:
        assert torch.equal(cpu.keep, gpu.keep.cpu())


def _trunk_and_images() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    trunk = build_vit("vit_small", 3, 224, 16).cuda()
    return trunk, torch.randn(8, 3, 224, 224, device="cuda")


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_fused_attention_kernels_train_a_vit_in_bf16(backend: str) -> None:
    """timm's Attention calls scaled_dot_product_attention (fused_attn); each fused kernel, forced, runs the forward
    and backward of ViT-S/16 under bf16 autocast and agrees with PyTorch's math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    trunk, x = _trunk_and_images()
    assert all(block.attn.fused_attn for block in trunk.blocks)
    outs = {}
    for kind in (backend, "MATH"):
        trunk.zero_grad()
        with sdpa_kernel(getattr(SDPBackend, kind)), torch.autocast("cuda", dtype=torch.bfloat16):
            out = trunk(x)
        out.float().pow(2).mean().backward()
        outs[kind] = (out.float(), trunk.blocks[0].attn.qkv.weight.grad.clone())
    assert torch.allclose(outs[backend][0], outs["MATH"][0], atol=5e-2, rtol=5e-2)
    assert torch.allclose(outs[backend][1], outs["MATH"][1], atol=5e-2, rtol=1e-1)


def test_padding_slots_take_the_memory_efficient_kernel() -> None:
    """A context with padding (keep_valid, I-JEPA) has an attention mask: flash attention cannot take one, the
    memory-efficient kernel can."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    trunk, x = _trunk_and_images()
    keep = torch.arange(100, device="cuda").expand(8, 100)
    valid = torch.arange(100, device="cuda").expand(8, 100) < 80
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        padded = trunk.forward_tokens(x, keep=keep, keep_valid=valid).cls.float()
        alone = trunk.forward_tokens(x, keep=keep[:, :80]).cls.float()
    assert torch.allclose(padded, alone, atol=5e-2, rtol=5e-2)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mae", "dino_vit", "lejepa", "ibot", "dinov2", "dinov3", "ijepa"])
def test_deterministic_vit_runs_and_resumes_are_bit_identical(tmp_path: Path, recipe: str) -> None:
    """machine.deterministic=true on CUDA, with the attention kernels it allows: two runs, and a run killed mid-epoch
    and resumed, end with identical checkpoints."""
    args = [f"config={recipe}", *BASE, *(RECIPE_ARGS.get(recipe) or RECIPES[recipe]), *GPU,
            "machine.deterministic=true", "optim.epochs=2", "checkpoint.every_n_steps=4"]
    never = hooks_override(recipe, {"name": "fault_signal", "step": 10**6})
    kill = hooks_override(recipe, {"name": "fault_signal", "step": 10, "signal": "SIGKILL"})
    run_cli(*args, never, f"output_dir={tmp_path / 'a'}", env=FAULT_ENV)
    run_cli(*args, never, f"output_dir={tmp_path / 'b'}", env=FAULT_ENV)
    reference = latest_state(tmp_path / "a")
    assert_identical(latest_state(tmp_path / "b"), reference)
    out = tmp_path / "killed"
    assert run_cli(*args, kill, f"output_dir={out}", env=FAULT_ENV, check=False).returncode != 0
    run_cli(*args, kill, f"output_dir={out}", env=FAULT_ENV)
    assert_identical(latest_state(out), reference)


@pytest.mark.slow
def test_mae_at_vit_s16_224_trains_in_bf16(tmp_path: Path) -> None:
    """The paper's shape: ViT-S/16 at 224 px (196 patches, 49 kept), a 512-d decoder, on synthetic images."""
    out = tmp_path / "run"
    proc = run_cli(*MAE_VIT_S16_224, *GPU, f"output_dir={out}")
    assert "step 3/3" in proc.stdout


def test_distillation_parts_on_cuda_equal_the_cpu_and_never_sync() -> None:
    """KoLeo, Sinkhorn-Knopp with padding rows, the masked slots and iBOT's patch loss: the same numbers on the GPU as
    on the CPU, and not one host-device synchronisation (``set_sync_debug_mode("error")`` raises on any)."""
    from sslkit.methods.dinov2_parts import gather_slots, koleo_loss, masked_patch_loss, masked_slots
    from sslkit.methods.sinkhorn import sinkhorn_knopp

    g = torch.Generator().manual_seed(0)
    logits, x = torch.randn(64, 32, generator=g), torch.randn(64, 16, generator=g)
    weight = (torch.rand(64, generator=g) < 0.7).float()
    tokens, student = torch.randn(8, 16, 12, generator=g), torch.randn(8, 6, 32, generator=g)
    proj = torch.randn(12, 32, generator=g)
    mask = BlockMasking(probability=0.8, ratio_min=0.1, ratio_max=0.35, min_patches=2)(
        SampleKeys(0, 0, torch.arange(8)), (4, 4)).mask

    def parts(mask, tokens, proj, logits, weight, x, student) -> list[torch.Tensor]:
        index, w = masked_slots(mask, 6)
        probs = torch.softmax(gather_slots(tokens, index) @ proj, -1)
        return [sinkhorn_knopp(logits, 0.05, 3, weight), koleo_loss(x), index, w, masked_patch_loss(student, probs, w)]

    inputs = (mask, tokens, proj, logits, weight, x, student)
    cpu = parts(*inputs)
    on_gpu = [t.cuda() for t in inputs]  # (a copy from pageable host memory synchronises: before the check)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = parts(*on_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(cpu, gpu):
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)


def test_ibot_model_and_dinov2_loss_train_a_step_in_bf16_without_a_sync() -> None:
    """The ibot model (mask token, masked slots, teacher) and DINOv2's loss with Sinkhorn-Knopp under bf16 autocast:
    finite, gradients reach the mask token, no host-device synchronisation in the forward and backward."""
    from sslkit.methods.dino import build_dino_head
    from sslkit.methods.dinov2 import DINOv2Loss
    from sslkit.methods.ibot import build_ibot

    torch.manual_seed(0)
    trunk = build_vit("vit_small", 3, 64, 16, depth=2)
    model = build_ibot(trunk, build_dino_head(trunk.out_dim, out_dim=32, hidden_dim=64, bottleneck_dim=16)).cuda()
    loss_fn = DINOv2Loss(out_dim=32, centering="sinkhorn_knopp").cuda().train()
    views = [torch.randn(16, 3, 64, 64, device="cuda") for _ in range(2)] + [torch.randn(16, 3, 32, 32, device="cuda")]
    gen = BlockMasking(probability=0.5, ratio_min=0.1, ratio_max=0.5, min_patches=2)
    masks = [gen(SampleKeys(0, 0, torch.arange(16, device="cuda"), v), (4, 4)) for v in range(2)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = loss_fn(model(views, masks), {})
        out["loss"].backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out["loss"]).item() and torch.isfinite(out["koleo_loss"]).item()
    assert model.trunk.mask_token.grad is not None and model.trunk.mask_token.grad.abs().sum().item() > 0


def test_ijepa_model_and_loss_train_a_step_in_bf16_without_a_sync() -> None:
    """I-JEPA at ViT-S/16 224 px (multi-block masks drawn on the GPU, the padded context, the predictor's attention
    mask, the layer-normalised targets) under bf16 autocast: finite, the predictor's mask token learns, the target
    encoder gets no gradient, no host-device synchronisation in the masks, the forward or the backward."""
    from sslkit.methods.ijepa import IJEPALoss, build_ijepa

    torch.manual_seed(0)
    trunk = build_vit("vit_small", 3, 224, 16, depth=2, pool="avg", pos_embed="sincos")
    model = build_ijepa(trunk, predictor_dim=384, predictor_depth=2).cuda()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        masks = MultiBlockMasking()(SampleKeys(0, 0, torch.arange(8, device="cuda")), (14, 14))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = IJEPALoss()(model([x], [masks]), {})
        out["loss"].backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out["loss"]).item() and 0.5 < out["target_std"].item() < 1.5
    assert model.predictor.mask_token.grad.abs().sum().item() > 0
    assert all(p.grad is None for p in model.teacher_trunk.parameters())


@pytest.mark.parametrize("recipe", ["dinov2", "ijepa"])
def test_activation_checkpointing_changes_no_number_on_cuda(tmp_path: Path, recipe: str) -> None:
    """model.activation_checkpointing on CUDA in bf16 under machine.deterministic=true: the recomputed blocks (drop
    path restored from the CUDA RNG state checkpointing saves), KoLeo's one-hot neighbours and the clipping through
    get_total_norm end 3 updates bit-identical to the run that kept every activation (the CPU twin:
    tests/distributed/test_fsdp.py::test_activation_checkpointing_changes_no_number)."""
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    states = []
    for ac in ("false", "true"):
        cfg = compose_config([f"config={recipe}", *SMALL, *RECIPES[recipe], *GPU, "machine.deterministic=true",
                              "optim.max_steps=3", "model.trunk_kwargs.drop_path_rate=0.1", "eval.knn.enabled=false",
                              "log.tensorboard=false", "checkpoint.every_n_epochs=0",
                              f"model.activation_checkpointing={ac}", f"output_dir={tmp_path / ac}"])
        (tmp_path / ac).mkdir()
        task = build_task(cfg)
        assert hasattr(task.base_model.trunk.blocks[0].forward, "__wrapped__") == (ac == "true")
        try:
            train(task, standard_train_step)
        finally:
            task.close()
        states.append({k: v.detach().cpu() for k, v in task.base_model.state_dict().items()})
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_sharded_checkpoints_of_a_cuda_run_resume_bit_identically(tmp_path: Path, async_save: str) -> None:
    """checkpoint.sharded=true on CUDA (with async_save: the state staged from the GPU to host memory while the run
    goes on): a deterministic dinov2 run killed mid-epoch resumes from its folder onto the GPU and ends identical to
    the uninterrupted run, folders holding the same state as that run's files; the folder's CUDA loss and hook
    states read onto the CPU, as a file's are."""
    from sslkit.checkpoint import Checkpointer

    recipe = "dinov2"
    args = [f"config={recipe}", *BASE, *(RECIPE_ARGS.get(recipe) or RECIPES[recipe]), *GPU,
            "machine.deterministic=true", "optim.epochs=2", "checkpoint.every_n_steps=4"]
    sharded = ["checkpoint.sharded=true", f"checkpoint.async_save={async_save}"]
    never = hooks_override(recipe, {"name": "fault_signal", "step": 10**6})
    kill = hooks_override(recipe, {"name": "fault_signal", "step": 10, "signal": "SIGKILL"})
    run_cli(*args, never, f"output_dir={tmp_path / 'files'}", env=FAULT_ENV)
    reference = latest_state(tmp_path / "files")
    out = tmp_path / "killed"
    assert run_cli(*args, *sharded, kill, f"output_dir={out}", env=FAULT_ENV, check=False).returncode != 0
    assert Checkpointer(str(out)).latest() is not None  # a complete folder (an async one may not be)
    run_cli(*args, *sharded, kill, f"output_dir={out}", env=FAULT_ENV)
    got = latest_state(out)  # the folder read whole, optimizer included (parameters by name)
    for key in ("loss", "hooks", "position"):
        assert_identical(got[key], reference[key], key)
    assert_identical({k: got["model"][k] for k in sorted(got["model"])},
                     {k: reference["model"][k] for k in sorted(reference["model"])})


def test_the_teacher_is_deterministic_on_cuda_in_bf16_with_fused_attention() -> None:
    """The silenced teacher (sslkit.models.teacher.silence) on CUDA: drop path drawn by the CUDA generator and the
    attention dropout that timm hands to the fused kernel (``dropout_p``) are both off, under bf16 autocast; the
    student, with the same rates, still draws them. The CPU check: tests/models/test_teacher.py."""
    from sslkit.builder import build_model
    from sslkit.config.compose import compose_config

    cfg = compose_config(["config=dino_vit", *SMALL, *RECIPES["dino_vit"], "model.trunk_kwargs.drop_path_rate=0.5",
                          "+model.trunk_kwargs.attn_drop_rate=0.3"])
    torch.manual_seed(0)
    model = build_model(cfg, in_channels=3).cuda().train()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert not torch.equal(model.trunk(x), model.trunk(x))
        assert torch.equal(model.teacher_trunk(x), model.teacher_trunk(x))


def test_the_dinov3_trunk_trains_in_bf16_with_its_rotary_embeddings_on_the_device() -> None:
    """timm's DINOv3 ViT-S/16 under bf16 autocast on CUDA: the rotary embeddings (built on the CPU by timm, as its
    augmentation's generator) reach the device, the dropped-patch path (keep) gathers them there, the forward and
    backward are finite and agree with the float32 forward to bf16 rounding."""
    from sslkit.models.rope_vit import build_rope_vit

    torch.manual_seed(0)
    trunk = build_rope_vit("vit_small_patch16_dinov3", 3, 224, rope_jitter_coords=1.2).cuda().train()
    x = torch.randn(4, 3, 224, 224, device="cuda")
    keep = torch.stack([torch.randperm(196, device="cuda")[:49] for _ in range(4)])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        tokens = trunk.forward_tokens(x, keep=keep)
    tokens.patches.float().pow(2).mean().backward()
    assert tokens.patches.device.type == "cuda" and torch.isfinite(tokens.patches).all()
    assert torch.isfinite(trunk.blocks[0].attn.qkv.weight.grad).all()
    trunk.eval()
    with torch.no_grad():
        full = trunk(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            half = trunk(x)
    assert torch.allclose(half.float(), full, atol=5e-2, rtol=5e-2)


def test_the_rotary_embeddings_reach_the_device_without_a_sync_and_as_timms_on_the_cpu() -> None:
    """timm builds a RoPE ViT's coordinates on the host and copies them with a blocking copy (a sync per forward);
    the trunk computes them on a host copy of its RoPE module and sends them from pinned memory: timm's values and
    random draws (the jittered embedding of a seed is the CPU trunk's), no sync after the first call."""
    from sslkit.models.rope_vit import build_rope_vit

    torch.manual_seed(0)
    cpu = build_rope_vit("vit_small_patch16_dinov3", 3, 64, rope_jitter_coords=1.5).train()
    gpu = copy.deepcopy(cpu).cuda()
    gpu.rope_embed(4, 4)  # (the host copy is made at the first call)
    for training in (True, False):
        cpu.train(training), gpu.train(training)
        torch.manual_seed(1)
        want = cpu.rope_embed(4, 6)
        torch.manual_seed(1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = gpu.rope_embed(4, 6)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.device.type == "cuda" and got.shape == want.shape == (24, want.shape[1])
        assert torch.equal(got.cpu(), want)
    torch.manual_seed(2)
    assert not torch.equal(cpu.train().rope_embed(4, 6), want)  # (training jitters: the check above is not vacuous)
    assert "_host_rope" not in str(list(gpu.state_dict()))


def test_the_gram_loss_runs_on_the_device_in_bf16_without_a_sync() -> None:
    """DINOv3's Gram loss on CUDA (features from a bf16 forward, computed in float32): the CPU's value, at the
    batch level with a token selection too (weights, no boolean indexing), and no host-device sync."""
    from sslkit.methods.gram import gram_loss, gram_token_weights

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(4, 49, 64, generator=g), torch.randn(4, 49, 64, generator=g)
    masks = torch.rand(4, 49, generator=g) < 0.4
    cpu = [gram_loss(s, t), gram_loss(s, t, image_level=False, weights=gram_token_weights(masks, "masked"))]
    sc, tc, mc = s.cuda().bfloat16(), t.cuda().bfloat16(), masks.cuda()  # (a copy from the host waits: not watched)
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = [gram_loss(sc, tc), gram_loss(sc, tc, image_level=False, weights=gram_token_weights(mc, "masked"))]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(cpu, gpu):
        assert b.dtype == torch.float32 and b.device.type == "cuda"
        assert torch.allclose(b.cpu(), a, rtol=2e-2, atol=1e-4)


@pytest.mark.slow
def test_dinov3_trains_in_bf16_and_its_dense_probe_runs_on_the_device(tmp_path: Path) -> None:
    """dinov3 on CUDA in bf16: the Gram teacher a snapshot (a copy on the device) before every update from the
    second, the Gram loss finite in the log; then sslkit dense on the device under the run's autocast (the frozen
    trunk in bf16, the head's BatchNorm and cross-entropy in float32): a finite mIoU, and the per-class pixel counts
    (bincount on the device) equal to the CPU's for the same predictions."""
    import json

    from sslkit.evaluation.dense import area_stats
    from sslkit.launch.cli import console

    out = tmp_path / "run"
    run_main("config=dinov3", *SMALL, *RECIPES["dinov3"], *GPU, "optim.max_steps=4", "log.every_n_steps=1",
             "eval.knn.enabled=false", f"output_dir={out}")
    gram = [r["gram_loss"] for r in metrics(out) if "gram_loss" in r]
    assert len(gram) == 3 and all(math.isfinite(v) for v in gram)  # updates 1-3
    root = ade_folder(tmp_path / "ade", n_train=8, n_test=4)
    assert console(["dense", f"checkpoint={out}", "eval.dense.dataset=folder", f"eval.dense.path={root}",
                    "eval.dense.num_classes=2", "eval.dense.epochs=2", "eval.dense.batch_size=4"]) == 0
    record = json.loads((out / "eval" / "dense.json").read_text())
    assert math.isfinite(record["miou"]) and 0.0 <= record["miou"] <= 1.0
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randint(0, 5, (4, 64, 64), generator=g), torch.randint(0, 5, (4, 64, 64), generator=g)
    target[:, 0] = 255
    assert torch.equal(area_stats(pred.cuda(), target.cuda(), 5).cpu(), area_stats(pred, target, 5))


@pytest.mark.slow
def test_dinov3_grows_its_crops_on_the_device_with_the_gram_teachers_high_resolution_crops(tmp_path: Path) -> None:
    """dinov3 on CUDA in bf16 with the Gram teacher on 48 px crops and a high-resolution phase from update 2: the
    teacher's patch map resized to the student's grid on the device (bicubic under autocast), each update fed the
    sizes the phase drew for it, the Gram loss finite; the same run again is bitwise the same in its log (the
    phase's draw and the crops depend on (seed, update) only)."""
    from sslkit.data.resolution import HighResPhase

    hires = ["hires.start_step=2", "hires.global_sizes=[40,48]", "hires.local_sizes=[16,24]",
             "hires.teacher_sizes=[64,72]", "hires.ratios=[0.5,0.5]", "gram.teacher_size=48"]
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        run_main("config=dinov3", *SMALL, *RECIPES["dinov3"], *GPU, *hires, "optim.max_steps=5",
                 "log.every_n_steps=1", "eval.knn.enabled=false", "machine.deterministic=true", f"output_dir={out}")
        runs.append([r for r in metrics(out) if r.get("phase") == "train" and "loss" in r])
    phase = HighResPhase(2, (40, 48), (16, 24), (64, 72), (0.5, 0.5), seed=0)
    sizes = [(r["crop_size"], r["teacher_crop_size"]) for r in runs[0]]
    assert sizes == [(32, 48), (32, 48)] + [phase.sizes(phase.choice(u))[::2] for u in (2, 3, 4)]
    assert all(math.isfinite(r["gram_loss"]) for r in runs[0][1:])
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]
