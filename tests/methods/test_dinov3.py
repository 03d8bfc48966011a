"""DINOv3: the Gram teacher (a snapshot, a file, the EMA teacher), when its hook refreshes it, the loss with Gram
anchoring against the formula written out here, and the Gram settings' config errors."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import RECIPES, SMALL, VIT, distillation_output, run_main

from sslkit.builder.model import build_model
from sslkit.clock import StepContext, TrainClock
from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.config.validate import validate
from sslkit.methods.dinov2 import DINOv2Loss
from sslkit.methods.dinov3 import DINOv3Loss, DINOv3Model, GramError, GramTeacherHook
from sslkit.models.masking import Masks
from sslkit.models.teacher import update_momentum

D3 = ["config=dinov3", *SMALL, *RECIPES["dinov3"]]


def _model(*extra: str) -> DINOv3Model:
    torch.manual_seed(0)
    model = build_model(compose_config([*D3, *extra]), in_channels=3)
    assert isinstance(model, DINOv3Model)
    return model


def _views(b: int = 3) -> tuple[list[torch.Tensor], list[Masks | None]]:
    g = torch.Generator().manual_seed(1)
    views = [torch.randn(b, 3, 32, 32, generator=g) for _ in range(2)] + [torch.randn(b, 3, 16, 16, generator=g)]
    masks: list[Masks | None] = [Masks((4, 4), torch.rand(b, 16, generator=g) < 0.4) for _ in range(2)]
    return views, masks


def _perturb(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


def test_the_gram_fields_come_only_once_the_gram_loss_is_on_and_are_the_gram_teachers_patches() -> None:
    model = _model()
    _perturb(model.gram_trunk, 2)  # a Gram teacher of its own, unlike the EMA teacher and the student
    views, masks = _views()
    off = model(views, masks)
    assert "gram_patches" not in off and "gram_targets" not in off
    model.gram_active = True
    on = model(views, masks)
    globals_ = torch.cat(views[:2])
    mask = torch.cat([m.mask for m in masks])
    with torch.no_grad():
        student = model.trunk.forward_tokens(globals_, mask=mask).patches
        gram = model.gram_trunk.forward_tokens(globals_).patches
        teacher = model.teacher_trunk.forward_tokens(globals_).patches
    torch.testing.assert_close(on["gram_patches"], student, rtol=0, atol=1e-6)  # the student saw the masked crops
    torch.testing.assert_close(on["gram_targets"], gram, rtol=0, atol=1e-6)
    assert not torch.allclose(gram, teacher)
    assert torch.equal(on["gram_masks"], mask)
    assert on["gram_patches"].requires_grad and not on["gram_targets"].requires_grad
    for key in ("projections", "targets", "patch_projections", "patch_targets"):  # iBOT's outputs unchanged
        for a, b in zip(off[key], on[key]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_with_gram_teacher_ema_the_targets_are_the_ema_teachers_patches_and_there_is_no_second_network() -> None:
    model = _model("gram.teacher=ema", "gram.every=0")
    assert model.gram_trunk is None and len(model.trunk_copies()) == 1
    model.gram_active = True
    views, masks = _views()
    out = model(views, masks)
    with torch.no_grad():
        teacher = model.teacher_trunk.forward_tokens(torch.cat(views[:2])).patches
    torch.testing.assert_close(out["gram_targets"], teacher, rtol=0, atol=1e-6)


def test_a_refresh_copies_the_ema_teacher_and_training_never_moves_the_gram_teacher() -> None:
    model = _model()
    gram_ids = {id(p) for p in model.gram_trunk.parameters()}
    assert not any(p.requires_grad for p in model.gram_trunk.parameters())
    assert gram_ids.isdisjoint(id(p) for p in model.parameters() if p.requires_grad)  # never in an optimizer
    _perturb(model.teacher_trunk, 3)
    model.refresh_gram_teacher()
    teacher = model.teacher_trunk.state_dict()
    for key, value in model.gram_trunk.state_dict().items():
        assert torch.equal(value, teacher[key]), key
    before = {k: v.clone() for k, v in model.gram_trunk.state_dict().items()}
    model.gram_active = True
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    views, masks = _views()
    out = model(views, masks)
    loss = DINOv3Loss(out_dim=16, patch_out_dim=16).train()
    loss(out, {})["loss"].backward()
    optimizer.step()
    for student, teacher_part in model.momentum_pairs():
        update_momentum(student, teacher_part, 0.5)
    first = next(k for k in before if k.startswith("blocks.0."))
    assert not torch.equal(model.teacher_trunk.state_dict()[first], before[first])  # the EMA teacher moved
    for key, value in model.gram_trunk.state_dict().items():
        assert torch.equal(value, before[key]), key  # the Gram teacher did not


def _snapshot_updates(start: int, every: int, most: int | None, updates: int) -> list[int]:
    """The updates before which the Gram teacher is a snapshot, written out: ``start``, then ``start + k every`` for
    ``k = 1 .. most`` (every ``every``; none when it is 0), inside the run."""
    out = [start]
    k = 1
    while every > 0 and (most is None or k <= most) and start + k * every < updates:
        out.append(start + k * every)
        k += 1
    return out


def _drive(hook: GramTeacherHook, model: DINOv3Model, updates: int, first: int = 0) -> list[tuple[int, float, bool]]:
    """Run the hook through a training run of ``updates`` updates: before each step ``u`` the EMA teacher's weights
    are set to ``u``; after it the clock reads ``u + 1`` and ``on_step`` fires. Returns, per update about to run, the
    Gram teacher's weight value (which step's teacher it copied) and whether the Gram loss is on."""
    clock = TrainClock(max_steps=updates, step=first)
    task = SimpleNamespace(base_model=model, clock=clock, train=True)
    seen = []
    with torch.no_grad():
        for p in model.teacher_trunk.parameters():
            p.fill_(-1.0)  # the teacher before the run's first update
    hook.on_start(task)
    for u in range(first, updates):
        seen.append((u, next(model.gram_trunk.parameters()).reshape(-1)[0].item(), model.gram_active))
        with torch.no_grad():
            for p in model.teacher_trunk.parameters():
                p.fill_(float(u))  # step u's EMA update
        clock.step = u + 1
        hook.on_step(task)
    return seen


@pytest.mark.parametrize(("start", "every", "most"), [(3, 4, 2), (0, 0, None), (5, 5, None), (2, 1, 3)])
def test_the_gram_teacher_is_the_ema_teacher_of_the_update_before_each_snapshot(start: int, every: int,
                                                                                  most: int | None) -> None:
    model = _model()
    hook = GramTeacherHook(start_step=start, every=every, max_refreshes=most)
    seen = _drive(hook, model, 16)
    expected = _snapshot_updates(start, every, most, 16)
    assert hook.snapshots == expected
    latest = None  # the step whose teacher the Gram teacher holds: the one before the latest snapshot
    for u, value, active in seen:
        if u in expected:
            latest = u - 1
        assert active == (u >= start), u
        if latest is not None:
            assert value == float(latest), (u, value, latest)


def test_a_gram_teacher_read_from_a_file_is_the_first_one_and_refreshes_follow(tmp_path: Path) -> None:
    donor = _model()
    _perturb(donor.teacher_trunk, 4)
    path = tmp_path / "model.pth"
    torch.save({"model": donor.state_dict()}, path)  # an sslkit checkpoint: its EMA teacher is the Gram teacher
    model = _model("gram.teacher=file", f"gram.checkpoint={path}")
    hook = GramTeacherHook(start_step=2, every=3, max_refreshes=1, teacher="file", checkpoint=str(path))
    clock = TrainClock(max_steps=10)
    task = SimpleNamespace(base_model=model, clock=clock, train=True)
    hook.on_start(task)
    expected = donor.teacher_trunk.state_dict()
    for key, value in model.gram_trunk.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert not torch.equal(next(model.gram_trunk.parameters()), next(model.teacher_trunk.parameters()))
    for u in range(10):
        clock.step = u + 1
        hook.on_step(task)
    assert hook.snapshots == [-1, 5]  # read at the start, not replaced at update 2, refreshed once at 5


def test_a_resumed_hook_takes_no_snapshot_twice_and_one_it_missed_at_once() -> None:
    model = _model()
    hook = GramTeacherHook(start_step=3, every=2, max_refreshes=None)
    _drive(hook, model, 6)  # snapshots before 3 and 5: handled up to update 5
    state = hook.state_dict()
    assert state == {"handled": 5, "snapshots": [3, 5]}
    again = GramTeacherHook(start_step=3, every=2, max_refreshes=None)
    again.load_state_dict(state)
    clock = TrainClock(max_steps=10, step=5)
    task = SimpleNamespace(base_model=model, clock=clock, train=True)
    again.on_start(task)
    assert again.snapshots == [3, 5] and model.gram_active
    behind = GramTeacherHook(start_step=3, every=2, max_refreshes=None)
    behind.load_state_dict({"handled": 4, "snapshots": [3]})  # a checkpoint written before the snapshot of 5
    behind.on_start(task)
    assert behind.snapshots == [3, 5]


def test_a_gram_start_after_the_run_stops_the_hook_before_training() -> None:
    hook = GramTeacherHook(start_step=10)
    task = SimpleNamespace(base_model=_model(), clock=TrainClock(max_steps=10), train=True)
    with pytest.raises(GramError, match=r"gram.start_step=10 is after the run's last update \(10 updates"):
        hook.on_start(task)


def _gram_mse(student: torch.Tensor, teacher: torch.Tensor) -> float:
    """Per image: the mean over the N x N entries of (cos(s_i, s_j) - cos(t_i, t_j))^2, averaged over the images."""
    total = 0.0
    for s, t in zip(student, teacher):
        n = s.shape[0]
        acc = 0.0
        for i in range(n):
            for j in range(n):
                cs = F.cosine_similarity(s[i], s[j], dim=0).item()
                ct = F.cosine_similarity(t[i], t[j], dim=0).item()
                acc += (cs - ct) ** 2
        total += acc / n**2
    return total / student.shape[0]


def _output_with_gram(seed: int) -> dict:
    out = distillation_output(seed, b=4, m=3, k=6, masked=0.6)
    g = torch.Generator().manual_seed(seed + 100)
    out["gram_patches"] = torch.randn(8, 5, 4, generator=g)
    out["gram_targets"] = torch.randn(8, 5, 4, generator=g)
    out["gram_masks"] = torch.rand(8, 5, generator=g) < 0.5
    return out


def test_the_loss_is_dinov2s_plus_the_weighted_gram_loss() -> None:
    out = _output_with_gram(0)
    common = dict(out_dim=6, teacher_temp=0.05, warmup_teacher_temp=0.05, koleo_weight=0.3)
    dinov2 = DINOv2Loss(**common).eval()(out, {})
    got = DINOv3Loss(**common, gram_weight=0.7).eval()(out, {})
    gram = _gram_mse(out["gram_patches"], out["gram_targets"])
    assert got["gram_loss"].item() == pytest.approx(gram, rel=1e-5)
    assert got["loss"].item() == pytest.approx(dinov2["loss"].item() + 0.7 * gram, rel=1e-5)
    without = {k: v for k, v in out.items() if not k.startswith("gram_")}  # before gram.start_step
    plain = DINOv3Loss(**common, gram_weight=0.7).eval()(without, {})
    assert "gram_loss" not in plain and plain["loss"].item() == pytest.approx(dinov2["loss"].item(), rel=1e-6)


def test_masked_tokens_compare_the_masked_patches_of_the_whole_batch() -> None:
    out = _output_with_gram(1)
    got = DINOv3Loss(out_dim=6, gram_tokens="masked", gram_image_level=False).eval()(out, {})
    rows = out["gram_masks"].reshape(-1)
    s = out["gram_patches"].reshape(-1, 4)[rows]
    t = out["gram_targets"].reshape(-1, 4)[rows]
    assert got["gram_loss"].item() == pytest.approx(_gram_mse(s[None], t[None]), rel=1e-5)


def test_the_gram_weight_is_zero_before_the_start_then_rises_by_a_half_cosine() -> None:
    loss = DINOv3Loss(out_dim=6, gram_weight=2.0, gram_start_step=10, gram_ramp_steps=5)
    for update in range(25):
        if update < 10:
            expected = 0.0
        elif update < 15:
            expected = 2.0 * (1 - math.cos(math.pi * (update - 10) / 4)) / 2
        else:
            expected = 2.0
        assert loss.gram_weight.at(TrainClock(step=update, max_steps=25)) == pytest.approx(expected, abs=1e-12)
    ctx = StepContext(clock=TrainClock(step=12, max_steps=25), train=False, device=torch.device("cpu"))
    loss.eval()(_output_with_gram(2), {}, ctx)
    assert ctx.scheduled["gram_weight"] == pytest.approx(1.0)


def test_bad_gram_options_are_refused() -> None:
    with pytest.raises(GramError, match=re.escape("gram.tokens='some'")):
        DINOv3Loss(gram_tokens="some")
    with pytest.raises(GramError, match=re.escape("needs gram.image_level=false")):
        DINOv3Loss(gram_tokens="masked")
    with pytest.raises(GramError, match=re.escape("gram.negatives='all'")):
        DINOv3Loss(gram_negatives="all")
    model = _model()
    with pytest.raises(GramError, match=re.escape("gram.teacher='copy'")):
        DINOv3Model(model.trunk, model.head, gram_teacher="copy")


@pytest.mark.parametrize(("extra", "message"), [
    (["optim.max_steps=5", "gram.start_step=5"],
     "'gram.start_step' = 5 is after the run's end: it makes 5 steps"),
    (["gram.start_step=8"], "'gram.start_step' = 8 is after the run's end: it makes 8 steps"),
    (["gram.teacher=file"], "'gram.teacher' = file: a Gram teacher without a source. Set gram.checkpoint=PATH"),
    (["gram.checkpoint=/no/such.pth"], "'gram.checkpoint' = /no/such.pth is read with gram.teacher=file only"),
    (["gram.teacher=file", "gram.checkpoint=/no/such.pth"], "'gram.checkpoint' = /no/such.pth: no such file"),
    (["gram.teacher=ema", "gram.every=3"], "'gram.every' > 0 with gram.teacher=ema"),
    (["gram.tokens=masked"], "'gram.tokens' = masked selects patches across the images of a batch: set "
                             "gram.image_level=false"),
    (["gram.teacher=snap"], "'gram.teacher' = snap: use one of snapshot, file, ema"),
    (["gram.start_step=-1"], "'gram.start_step' must be an update number >= 0, got -1"),
])
def test_bad_gram_settings_are_config_errors_naming_the_key(extra: list[str], message: str) -> None:
    """The small recipe makes 2 epochs of 64 / 16 = 4 updates: 8."""
    with pytest.raises(ConfigError) as info:
        validate(compose_config([*D3, *extra]))
    assert message in str(info.value)


def test_gram_settings_for_a_method_without_gram_anchoring_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'gram.weight' is set, but method.name=dinov2 does not read it: the gram "
                                          r"keys are read by method.name=dinov3 only"):
        validate(compose_config(["config=dinov2", *SMALL, *RECIPES["dinov2"], "gram.weight=2.0"]))


@pytest.mark.slow
def test_the_recipe_trains_with_the_gram_loss_from_its_start(tmp_path: Path) -> None:
    """Through the CLI: no Gram loss before gram.start_step, then logged; the Gram teacher is in the checkpoint,
    equal to the EMA teacher as it was after the step before the last snapshot."""
    out = tmp_path / "run"
    run_main(*D3, "optim.max_steps=4", "gram.start_step=2", "gram.every=0", "log.every_n_steps=1",
             "eval.knn.enabled=false", f"output_dir={out}")
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if r.get("phase") == "train" and "loss" in r}
    assert "gram_loss" not in steps[1] and "gram_loss" not in steps[2]  # updates 0 and 1
    assert steps[3]["gram_loss"] > 0 and steps[4]["gram_loss"] > 0
    from reliability_helpers import latest_state

    state = latest_state(out)
    gram = {k: v for k, v in state["model"].items() if k.startswith("gram_trunk.")}
    assert gram and state["hooks"]["gram_teacher"]["snapshots"] == [2]


def test_dinov3_adapt_without_its_weights_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").touch()
    with pytest.raises(ConfigError, match=re.escape("'model.pretrained' must be given: the recipe (config=...) lists")):
        compose_config(["config=dinov3_adapt", "data=folder", f"data.train.path={tmp_path}", "machine.device=cpu"])


@pytest.mark.slow
def test_dinov3_adapt_continues_from_released_weights_which_stay_its_gram_anchor(tmp_path: Path) -> None:
    """config=dinov3_adapt on a folder of JPEGs from a ViT-S/16 file in timm's layout (written here: no hub is
    reachable): the student, the EMA teacher and the Gram teacher start as the file; in the first epoch only the
    fresh heads train (the trunk frozen), and the Gram teacher stays the file (never refreshed)."""
    import timm
    from helpers import photo_folder
    from safetensors.torch import save_file

    from sslkit.builder import build_task
    from sslkit.hooks.checkpoint import CheckpointHook
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    photo_folder(tmp_path / "images", n=6)
    base = ["config=dinov3_adapt", "data=folder", f"data.train.path={tmp_path / 'images'}", "machine.device=cpu"]
    file = tmp_path / "released.safetensors"
    file.touch()  # (config validation checks that the file exists; its weights are written below)
    arch, spec = build_model(compose_config([*base, f"model.pretrained={file}"]), in_channels=3).trunk.timm_spec()
    torch.manual_seed(11)
    released = timm.create_model(arch, **spec).state_dict()
    save_file(released, str(file))
    cfg = compose_config([*base, f"model.pretrained={file}", "data.limit=4",
                          "data.batch_size=2", "data.num_workers=0", "optim.max_steps=1", "amp.enabled=false",
                          "loss.centering=centering", "eval.knn.enabled=false", "log.report=false",
                          "log.tensorboard=false", f"output_dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    task = build_task(cfg)
    task.hooks = [h for h in task.hooks if not isinstance(h, CheckpointHook)]
    model = task.base_model
    head = model.head.mlp[0].weight
    try:
        train(task, standard_train_step)
    finally:
        task.close()
    assert task.clock.step == 1
    for part in (model.trunk, model.teacher_trunk, model.gram_trunk):
        state = part.state_dict()
        for key, value in released.items():
            assert torch.equal(state[key], value), key
    assert task.optimizer.state[head]["exp_avg"].abs().sum() > 0  # the head trained (at lr 0: the warm-up's start)
    assert all(p not in task.optimizer.state for p in model.trunk.parameters())  # the trunk frozen in epoch 1


def test_with_teacher_crops_the_gram_targets_are_the_gram_teachers_patches_resized_to_the_students_grid() -> None:
    """DINOv3's high-resolution Gram teacher (get_gram_teacher_output): the teacher's patch map of the 48 px crops
    (6 x 6 patches) brought to the student's 4 x 4 grid by a bicubic resize, written out here."""
    model = _model()
    _perturb(model.gram_trunk, 3)
    model.gram_active = True
    views, masks = _views()
    g = torch.Generator().manual_seed(5)
    high = [torch.randn(3, 3, 48, 48, generator=g) for _ in range(2)]
    out = model(views, masks, teacher_views=high)
    with torch.no_grad():
        patches = model.gram_trunk.forward_tokens(torch.cat(high)).patches  # [6, 36, D]
    maps = patches.transpose(1, 2).reshape(6, -1, 6, 6)
    expected = F.interpolate(maps, size=(4, 4), mode="bicubic", align_corners=False).flatten(2).transpose(1, 2)
    torch.testing.assert_close(out["gram_targets"], expected, rtol=0, atol=1e-6)
    assert out["gram_patches"].shape == expected.shape
    plain = model(views, masks)  # without teacher crops: the student's crops, as before
    assert not torch.allclose(plain["gram_targets"], out["gram_targets"])
    with pytest.raises(ValueError, match="3 teacher crops for 6 global crops"):
        model(views, masks, teacher_views=high[:1])


@pytest.mark.parametrize(("extra", "message"), [
    (["gram.teacher=ema", "gram.every=0", "gram.teacher_size=48"],
     "'gram.teacher_size' gives the Gram teacher crops of its own, and gram.teacher=ema has no Gram teacher network"),
    (["gram.teacher_size=44"], "'gram.teacher_size' = 44"),
    (["gram.teacher_size=48", "data.transform.teacher_size=null"],
     "'gram.teacher_size' is set, but data.transform.teacher_size does not follow gram.teacher_size"),
    (["hires.start_step=8", "hires.global_sizes=[48]", "hires.local_sizes=[16]", "hires.ratios=[1]"],
     "'hires.start_step' = 8 is after the run's end: it makes 8 steps"),
    (["hires.start_step=2", "hires.global_sizes=[44]", "hires.local_sizes=[16]", "hires.ratios=[1]"],
     "'hires.global_sizes' holds 44: every size must be a multiple of the trunk's 8 px patch"),
    (["hires.start_step=2", "hires.global_sizes=[48]", "hires.local_sizes=[16]", "hires.ratios=[1]",
      "data.augment_on=device"], "'hires.start_step' is set with data.augment_on=device"),
])
def test_bad_teacher_crops_and_high_resolution_phases_are_config_errors(extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_config([*D3, *extra]))
    assert message in str(info.value)


def test_a_high_resolution_phase_on_a_cnn_or_teacher_crops_without_a_gram_teacher_are_config_errors() -> None:
    phase = ["hires.start_step=1", "hires.global_sizes=[48]", "hires.local_sizes=[16]", "hires.ratios=[1]"]
    with pytest.raises(ConfigError, match=re.escape("'hires.start_step' is set, but the trunk has no patch grid")):
        validate(compose_config(["config=simclr", *SMALL, *phase]))
    with pytest.raises(ConfigError, match=re.escape("'hires.teacher_sizes' is set, but method.name=simclr does "
                                                    "not read it")):
        validate(compose_config(["config=simclr_vit", *SMALL, *VIT, *phase, "hires.teacher_sizes=[64]"]))
    validate(compose_config(["config=simclr_vit", *SMALL, *VIT, *phase]))  # a ViT method grows its views


#: A phase from update 2 of the small recipe: two size triples, the Gram teacher's crops at 1.5 x the global ones.
HIRES = ["hires.start_step=2", "hires.global_sizes=[40,48]", "hires.local_sizes=[16,24]",
         "hires.teacher_sizes=[64,72]", "hires.ratios=[0.5,0.5]", "gram.teacher_size=48"]


@pytest.mark.slow
def test_the_recipe_grows_its_crops_from_the_phases_start_and_the_checkpoint_knows_the_stage(tmp_path: Path) -> None:
    """Through the CLI, 5 updates: 32 px global crops and the Gram teacher's at 48 px (gram.teacher_size) until
    update 2, then each update at the size triple the phase draws for it; the clock's stage in the checkpoint."""
    from sslkit.data.resolution import HighResPhase

    out = tmp_path / "run"
    run_main(*D3, *HIRES, "optim.max_steps=5", "log.every_n_steps=1", "eval.knn.enabled=false",
             "checkpoint.every_n_steps=1", "checkpoint.keep_last=0", f"output_dir={out}")
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if r.get("phase") == "train" and "loss" in r}
    phase = HighResPhase(2, (40, 48), (16, 24), (64, 72), (0.5, 0.5), seed=compose_config(D3).seed)
    for update in range(5):
        sizes = (32, 48) if update < 2 else phase.sizes(phase.choice(update))[::2]
        assert (steps[update + 1]["crop_size"], steps[update + 1]["teacher_crop_size"]) == sizes, update
    assert {phase.choice(u) for u in range(2, 5)} == {0, 1}  # both triples ran
    assert all(math.isfinite(steps[s]["gram_loss"]) for s in (2, 3, 4, 5))
    stages = [torch.load(out / "checkpoints" / f"checkpoint_{u:09d}.pt", weights_only=False)["position"]["stage"]
              for u in (2, 3)]
    assert stages == ["base", "high_res"]  # written after updates 1 and 2


def test_the_standin_recipe_can_be_extended_without_changing_what_it_trained(tmp_path: Path) -> None:
    """config=dinov3_standin (DINOv3's pretraining schedules: constant after the warm-up, no Gram loss): its first two
    epochs are the same updates, to the bit, whether the run was set for 2 epochs or for 4, so a run that has not
    stopped rising can be extended (and each epoch's kNN says where it stopped)."""
    import json

    cfg = compose_config(["config=dinov3_standin", "data=wild"])
    assert (cfg.optim.schedule, cfg.optim.final_weight_decay, cfg.gram.weight) == ("constant", None, 0.0)
    assert cfg.method.hooks.momentum_teacher.base_momentum == cfg.method.hooks.momentum_teacher.final_momentum
    assert cfg.eval.knn.every_n_epochs == 1 and cfg.model.trunk_kwargs.patch_size == 8  # 32 px: 8 px patches
    runs = {}
    for epochs in (2, 4):
        out = tmp_path / f"e{epochs}"
        run_main("config=dinov3_standin", *SMALL, *RECIPES["dinov3"], "optim.warmup_epochs=1", f"optim.epochs={epochs}",
                 "log.every_n_steps=1", "eval.knn.enabled=false", "eval.knn.every_n_epochs=0", f"output_dir={out}")
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[epochs] = {r["step"]: r for r in lines if "loss" in r and r.get("phase") != "eval"}
    assert sorted(runs[2]) == list(range(1, 9)) and set(runs[2]) < set(runs[4])
    for step, record in runs[2].items():
        for key in ("loss", "lr", "weight_decay", "teacher_momentum"):
            assert record[key] == runs[4][step][key], (step, key)
    assert runs[4][8]["lr"] == runs[4][16]["lr"] > runs[4][2]["lr"]  # constant after the warm-up's 4 updates
