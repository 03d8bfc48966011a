"""Distillation: both objectives against their formulas written out here, one teacher forward per step for several
students, a teacher that never changes, each student's own optimizer groups and clipping, the teacher read from a
weights file, a run folder and a sharded checkpoint, the export of any student, and the config errors."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import RECIPES, SMALL, run_main, run_sslkit

from sslkit import registry as R
from sslkit.builder.model import build_model
from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError
from sslkit.methods.dino import DINOHead
from sslkit.methods.distill import (
    DistillError,
    DistillLoss,
    DistillModel,
    FrozenTeacher,
    build_distill,
    dino_distillation_loss,
    feature_distillation_loss,
    student_specs,
)
from sslkit.models.masking import Masks
from sslkit.optim import param_groups
from sslkit.task import MicroBatch

DISTILL = ["config=distill", *SMALL, *RECIPES["distill"]]
QUIET = ["eval.knn.enabled=false", "log.tensorboard=false", "log.report=false"]


def _vit(patch: int = 8, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return R.get(R.TRUNKS, "vit_tiny")(in_channels=3, img_size=32, patch_size=patch, depth=2, num_heads=2)


def _dino_teacher() -> FrozenTeacher:
    """A ViT teacher with a DINO head and an iBOT head of 16 prototypes (fresh weights, seed 0)."""
    trunk = _vit()
    torch.manual_seed(1)
    head = DINOHead(192, out_dim=16, hidden_dim=32, bottleneck_dim=8)
    return FrozenTeacher(trunk, head, DINOHead(192, out_dim=16, hidden_dim=32, bottleneck_dim=8), source="test")


# ------------------------------------------------------------------------------------------------ the two objectives
def test_the_feature_terms_are_one_minus_cosine_or_the_mean_squared_error() -> None:
    s = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    t = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    # cosine: rows 1 - 1 and 1 - 1/sqrt(2), averaged; mse: (1 + 0 + 1 + 0) / 4
    assert feature_distillation_loss(s, t, "cosine").item() == pytest.approx((0 + 1 - 1 / math.sqrt(2)) / 2)
    assert feature_distillation_loss(s, t, "mse").item() == pytest.approx(0.5)
    s.requires_grad_(True)
    t.requires_grad_(True)
    feature_distillation_loss(s, t, "mse").backward()
    assert t.grad is None and s.grad is not None  # nothing flows into the teacher
    with pytest.raises(DistillError, match=re.escape("distill.metric='l1': use one of cosine, mse")):
        feature_distillation_loss(s, t, "l1")


def test_the_dino_term_is_the_cross_entropy_over_crop_pairs_and_koleo_the_nearest_neighbour_log() -> None:
    g = torch.Generator().manual_seed(0)
    views, batch, k = 3, 4, 5
    student = [torch.randn(batch, k, generator=g) for _ in range(views)]
    probs = torch.softmax(torch.randn(2, batch, k, generator=g), dim=-1)
    feats = [torch.randn(batch, 6, generator=g) for _ in range(views)]
    out = dino_distillation_loss(student, probs, feats, num_global=2, student_temp=0.1, koleo_weight=0.5)
    pairs = []
    for i in range(2):
        for v in range(views):
            if v != i:
                log_p = torch.log_softmax(student[v] / 0.1, dim=-1)
                pairs.append(-(probs[i] * log_p).sum(dim=-1).mean())
    dino = torch.stack(pairs).mean()
    koleo = 0.0
    for f in feats[:2]:
        z = F.normalize(f, dim=-1)
        d = torch.cdist(z, z) + torch.eye(batch) * 10
        koleo += -torch.log(d.min(dim=1).values + 1e-8).mean()
    assert out["dino_loss"].item() == pytest.approx(dino.item(), rel=1e-5)
    assert out["koleo_loss"].item() == pytest.approx(float(koleo), rel=1e-4)
    assert out["loss"].item() == pytest.approx(dino.item() + 0.5 * float(koleo), rel=1e-4)


def test_the_loss_sums_the_students_and_logs_each_ones_terms() -> None:
    teacher = FrozenTeacher(_vit(), source="t")
    cnn = R.get(R.TRUNKS, "small_cnn")(in_channels=3)
    model = build_distill(teacher=teacher, students={"a": _vit(seed=2), "b": cnn})
    out = model([torch.randn(2, 3, 32, 32)])
    loss = DistillLoss("feature", "cosine", global_weight=1.0, patch_weight=0.5)(out, {})
    for name, s in out["students"].items():
        glob = feature_distillation_loss(s.global_pred[0], out["teacher"].pooled[0], "cosine")
        patch = feature_distillation_loss(s.patch_pred[0], out["teacher"].patches[0], "cosine")
        assert loss[f"loss_{name}"].item() == pytest.approx((glob + 0.5 * patch).item(), rel=1e-6)
    assert loss["loss"].item() == pytest.approx((loss["loss_a"] + loss["loss_b"]).item(), rel=1e-6)
    # the CNN's 4 x 4 map of a 32 px image resized to the teacher's 4 x 4 grid of 8 px patches, 192 wide
    assert out["students"]["b"].patch_pred[0].shape == (2, 16, 192)


# --------------------------------------------------------------------------------------- one teacher, several students
def test_the_teacher_runs_once_per_step_whatever_the_number_of_students() -> None:
    teacher = _dino_teacher()
    calls = []
    teacher.trunk.register_forward_hook(lambda *_: calls.append(1))
    students = {"vit": _vit(seed=3), "cnn": R.get(R.TRUNKS, "small_cnn")(in_channels=3),
                "vit2": _vit(seed=4)}
    model = build_distill(teacher=teacher, students=students, objective="dino", head_kwargs={
        "hidden_dim": 32, "bottleneck_dim": 8})
    views = [torch.randn(3, 3, 32, 32) for _ in range(2)] + [torch.randn(3, 3, 16, 16)]
    masks = [Masks((4, 4), torch.rand(3, 16, generator=torch.Generator().manual_seed(i)) < 0.4) for i in range(2)]
    loss_fn = DistillLoss("dino", out_dim=16, patch_out_dim=16, centering="centering")
    for _ in range(2):
        out = model(views, masks)
        loss_fn(out, {})["loss"].backward()
    assert len(calls) == 2  # one teacher forward per step, shared by the three students
    assert out["students"]["vit"].patch_logits is not None and out["students"]["cnn"].patch_logits is None
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in model.students["cnn"].parameters() if p.requires_grad)


def _masked_pair() -> tuple[list[torch.Tensor], list[Masks], torch.Tensor]:
    views = [torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5 + i)) for i in range(2)]
    masks = [Masks((4, 4), torch.rand(3, 16, generator=torch.Generator().manual_seed(i)) < 0.4) for i in range(2)]
    return views, masks, torch.cat([m.mask for m in masks])  # [G B, N], crop after crop


@pytest.mark.parametrize("mask_student", [False, True])
def test_the_student_sees_its_crops_whole_unless_mask_student_and_learns_the_masked_slots(mask_student: bool) -> None:
    """DINOv3's distillation (``ssl_meta_arch.get_student_output``: ``masks if not self.is_distillation_enabled else
    None``): the student's global crops go in whole and its iBOT head reads its patch tokens at the masked places
    (``index_select`` of ``mask_indices_list``); ``mask_student=true``: the mask token replaces those patches first.
    Written out: the trunk's tokens with or without the mask, the patches where the mask is True, raster order."""
    views, masks, mask = _masked_pair()
    model = build_distill(teacher=_dino_teacher(), students={"vit": _vit(seed=3)}, objective="dino",
                          head_kwargs={"hidden_dim": 32, "bottleneck_dim": 8}, mask_student=mask_student)
    student = model.students["vit"]
    assert (student.trunk.mask_token is not None) == mask_student  # a mask token only where the student sees one
    out = model(views, masks)
    teacher, logits = out["teacher"], out["students"]["vit"].patch_logits
    tokens = student.trunk.forward_tokens(torch.cat(views), mask=mask if mask_student else None).patches
    expected = student.patch_head(tokens[mask])  # [masked patches of the two crops, K]
    kept = teacher.patch_weights > 0
    assert int(kept.sum()) == int(mask.sum())
    torch.testing.assert_close(logits[kept], expected, rtol=1e-5, atol=1e-6)
    assert "ibot_loss_vit" in DistillLoss("dino", out_dim=16, patch_out_dim=16, centering="centering")(out, {})


def test_a_vit_teachers_last_blocks_concatenated_are_lightly_trains_v2_targets() -> None:
    """``distill.teacher_blocks=2`` (LightlyTrain ``distillationv2``, ``n_teacher_blocks=2``: DINOv2's
    ``get_intermediate_layers(x, n=2, reshape=True)``, each block's output through the final norm, concatenated along
    the channels): the teacher's features per location, read here by hooks on its last two blocks; the pooled ones
    stay its final tokens'. The students' projections take the wider target."""
    teacher = FrozenTeacher(_vit(), source="t")
    seen: list[torch.Tensor] = []
    for block in teacher.trunk.blocks[-2:]:
        block.register_forward_hook(lambda _m, _a, out: seen.append(out))
    student = R.get(R.TRUNKS, "small_cnn")(in_channels=3)
    model = build_distill(teacher=teacher, students={"s": student}, teacher_blocks=2)
    x = torch.randn(2, 3, 32, 32)
    out = model([x])["teacher"]
    norm = teacher.trunk.norm
    expected = torch.cat([norm(seen[0])[:, 1:], norm(seen[1])[:, 1:]], dim=-1)  # [B, 16, 2 x 192]
    torch.testing.assert_close(out.patches[0], expected)
    torch.testing.assert_close(out.pooled[0], teacher.trunk(x))
    assert model.students["s"].patch_proj.out_features == 2 * 192 and teacher.patch_dim == 384
    with pytest.raises(DistillError, match=re.escape("distill.teacher_blocks=3: the teacher t has 2 blocks")):
        build_distill(teacher=FrozenTeacher(_vit(), source="t"), students={"s": student}, teacher_blocks=3)
    with pytest.raises(DistillError, match=re.escape("distill.teacher_blocks=2: the dino objective")):
        build_distill(teacher=_dino_teacher(), students={"s": _vit(seed=3)}, objective="dino", teacher_blocks=2,
                      head_kwargs={"hidden_dim": 32, "bottleneck_dim": 8})


def test_the_teacher_is_outside_the_state_the_optimizer_and_train_mode_and_follows_moves() -> None:
    teacher = FrozenTeacher(_vit(), source="t")
    model = build_distill(teacher=teacher, students={"s": R.get(R.TRUNKS, "small_cnn")(in_channels=3)})
    assert not any(k.startswith("teacher") for k in model.state_dict())
    assert all(id(p) not in {id(q) for q in teacher.parameters()} for p in model.parameters())
    model.train()
    assert not teacher.training and model.training
    model.to(torch.float64)
    assert next(teacher.parameters()).dtype == torch.float64
    assert model.trunk is model.students["s"].trunk


def test_each_student_has_its_own_groups_learning_rate_scale_and_clipping() -> None:
    from sslkit.train_steps.stages import clip_gradients

    teacher = FrozenTeacher(_vit(), source="t")
    model = build_distill(teacher=teacher, students={"a": R.get(R.TRUNKS, "small_cnn")(in_channels=3, width=4),
                                                     "b": R.get(R.TRUNKS, "small_cnn")(in_channels=3, width=4)},
                          lr_scales={"b": 0.5})
    groups = param_groups(model, weight_decay=0.05)
    assert [g["name"] for g in groups] == ["students.a.decay", "students.a.no_decay", "students.b.decay",
                                           "students.b.no_decay"]
    assert [g["lr_scale"] for g in groups] == [1.0, 1.0, 0.5, 0.5]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    for name, scale in (("a", 1.0), ("b", 100.0)):  # b's gradients far larger than a's
        for p in model.students[name].parameters():
            p.grad = torch.full_like(p, scale)
    a_before = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.students["a"].parameters()]))
    task = SimpleNamespace(optimizer=optimizer, clip_grad=1.0, clip_grad_mode="global",
                           perf_stats=SimpleNamespace(timer=lambda _n: __import__("contextlib").nullcontext()),
                           model=model, scaler=None, device=torch.device("cpu"))
    batch = MicroBatch(sample={})
    clip_gradients(task, batch)  # type: ignore[arg-type]
    for name in ("a", "b"):
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.students[name].parameters()]))
        assert norm.item() == pytest.approx(1.0, rel=1e-4)  # each clipped to 1 by its own norm
    assert batch.metrics["grad_norm_a"].item() == pytest.approx(a_before.item(), rel=1e-5)


# ------------------------------------------------------------------------------------------------ through the CLI
def test_a_run_trains_two_students_and_leaves_the_teacher_bitwise_as_read(tmp_path: Path) -> None:
    """build_task + train: after 3 updates the teacher's every tensor equals the file's, none has a gradient or is
    in the optimizer; both students moved; the checkpoint holds the students and the teacher's digest only."""
    from safetensors.torch import load_file

    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config as compose
    from sslkit.train_steps.standard import standard_train_step
    from sslkit.trainer import train

    cfg = compose([*DISTILL, *QUIET, "optim.max_steps=3", f"output_dir={tmp_path / 'run'}",
                   "distill.students=[small_cnn, {trunk: small_cnn, name: narrow, trunk_kwargs: {width: 8}}]"])
    (tmp_path / "run").mkdir()
    task = build_task(cfg)
    model: DistillModel = task.base_model
    before = {n: p.detach().clone() for n, p in model.students.named_parameters()}
    train(task, standard_train_step)
    teacher_file = load_file(RECIPES["distill"][0].split("=", 1)[1])
    for name, value in model.teacher.trunk.state_dict().items():
        assert torch.equal(value, teacher_file[name]), name
    assert all(p.grad is None and not p.requires_grad for p in model.teacher.parameters())
    in_optimizer = {id(p) for g in task.optimizer.param_groups for p in g["params"]}
    assert not in_optimizer & {id(p) for p in model.teacher.parameters()}
    moved = [n for n, p in model.students.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.startswith("small_cnn.") for n in moved) and any(n.startswith("narrow.") for n in moved)
    from reliability_helpers import latest_state

    saved = latest_state(tmp_path / "run")
    assert all(k.startswith("students.") for k in saved["model"])
    assert saved["hooks"]["distill_teacher"]["digest"] == model.teacher.digest


def test_the_teacher_hook_on_another_methods_model_names_the_method() -> None:
    from sslkit.methods.distill import DistillTeacherHook

    with pytest.raises(DistillError, match=re.escape("method.hooks.distill_teacher works on method.name=distill's "
                                                     "model, and the model is Linear")):
        DistillTeacherHook().on_start(SimpleNamespace(base_model=torch.nn.Linear(1, 1)))  # type: ignore[arg-type]


def test_a_resume_with_another_teacher_stops_and_names_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    file = tmp_path / "teacher.safetensors"
    state = load_file(RECIPES["distill"][0].split("=", 1)[1])
    save_file(state, str(file))
    args = [*DISTILL, *QUIET, f"distill.teacher={file}", "optim.max_steps=2", f"output_dir={tmp_path / 'run'}"]
    run_main(*args)
    state["cls_token"] = state["cls_token"] + 1.0
    save_file(state, str(file))
    proc = run_main(*args[:-2], "optim.max_steps=4", f"output_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode != 0
    assert "its weights are not those the run began with" in proc.stderr + proc.stdout


@pytest.fixture(scope="module")
def dino_teacher_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small dinov2 run (a ViT with DINO and shared iBOT heads), checkpoints sharded: the dino objective's
    teacher."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    run_main("config=dinov2", *SMALL, *RECIPES["dinov2"], "optim.max_steps=2", *QUIET, "checkpoint.sharded=true",
             f"output_dir={out}")
    return out


def test_the_dino_objective_distills_a_sharded_dinov2_run_into_a_vit_and_a_cnn(dino_teacher_run: Path,
                                                                               tmp_path: Path) -> None:
    folders = [p for p in (dino_teacher_run / "checkpoints").iterdir() if p.is_dir()]
    assert folders and (folders[0] / ".metadata").exists()  # a sharded checkpoint folder
    with pytest.raises(DistillError, match="takes 3-channel images and the data has 1"):  # (an RGB teacher)
        build_model(compose_config([*DISTILL, f"distill.teacher={folders[0]}", "distill.teacher_trunk=null"]), 1)
    out = tmp_path / "run"
    run_main(*DISTILL, *QUIET, f"distill.teacher={folders[0]}", "distill.teacher_trunk=null", "distill.objective=dino",
             "distill.students=[{trunk: vit_tiny, name: vit, trunk_kwargs: {patch_size: 8, depth: 1, num_heads: 2}}, "
             "small_cnn]", "masking.name=block", "data.transform.name=multicrop", "~data.transform.num_views",
             "+data.transform.image_size=32", "+data.transform.small_size=16", "data.transform.num_small=2",
             "model.head.bottleneck_dim=8", "model.head.hidden_dim=32", "optim.max_steps=2", "log.every_n_steps=1",
             f"output_dir={out}")
    import json

    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r.get("phase") == "train" and "loss" in r][-1]
    assert {"dino_loss_vit", "ibot_loss_vit", "koleo_loss_vit", "dino_loss_small_cnn"} <= set(last)
    assert "ibot_loss_small_cnn" not in last  # a CNN has no masked patches
    assert all(math.isfinite(last[k]) for k in ("loss_vit", "loss_small_cnn"))


def test_any_student_exports_by_name_and_loads_into_its_own_trunk(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "run"
    run_main(*DISTILL, *QUIET, "optim.max_steps=1", f"output_dir={out}",
             "distill.students=[small_cnn, {trunk: small_cnn, name: narrow, trunk_kwargs: {width: 8}}]")
    code, _, err = run_sslkit("export", f"checkpoint={out}", "student=narrow", "twin=none",
                              f"output={tmp_path / 'n.safetensors'}")
    assert code == 0, err
    narrow = R.get(R.TRUNKS, "small_cnn")(in_channels=3, width=8)
    narrow.load_state_dict(load_file(str(tmp_path / "n.safetensors")), strict=True)
    code, _, err = run_sslkit("export", f"checkpoint={out}", "twin=none", f"output={tmp_path / 'first.safetensors'}")
    assert code == 0, err
    assert load_file(str(tmp_path / "first.safetensors"))["features.0.weight"].shape[0] == 32  # the first student
    code, _, err = run_sslkit("export", f"checkpoint={out}", "student=wide")
    assert code != 0 and "student=wide: the run's students are small_cnn, narrow" in err
    code, _, err = run_sslkit("knn", f"checkpoint={out}", "student=narrow", f"output={tmp_path / 'knn.json'}")
    assert code == 0, err
    import json

    assert json.loads((tmp_path / "knn.json").read_text())["feature_dim"] == 64 * 16  # narrow: 8 x 8 wide, 4 x 4 grid


def test_a_timm_architecture_with_a_local_weights_file_is_a_teacher(tmp_path: Path) -> None:
    """distill.teacher_trunk=timm:NAME: any timm model, its weights in its own layout; its pooled pre-logits features
    and its forward_features map (a CNN's here: resnet18's 512-channel map, 1 x 1 at 32 px) are the targets."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = timm.create_model("resnet18", pretrained=False, num_classes=0)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp_path / "r18.safetensors"))
    cfg = compose_config([*DISTILL, f"distill.teacher={tmp_path / 'r18.safetensors'}",
                          "distill.teacher_trunk=timm:resnet18", "distill.teacher_trunk_kwargs={}"])
    model = build_model(cfg, in_channels=3)
    x = torch.randn(2, 3, 32, 32)
    out = model([x])
    with torch.no_grad():
        expected = net.eval()(x)
    assert torch.allclose(out["teacher"].pooled[0], expected, atol=1e-5)
    assert out["teacher"].patches[0].shape == (2, 1, 512)
    (tmp_path / "bad.safetensors").write_bytes(b"not weights")
    with pytest.raises(DistillError, match="cannot be read as weights"):
        build_model(compose_config([*DISTILL, f"distill.teacher={tmp_path / 'bad.safetensors'}",
                                    "distill.teacher_trunk=timm:resnet18", "distill.teacher_trunk_kwargs={}"]), 3)
    with pytest.raises(DistillError, match=re.escape("is another network than distill.teacher_trunk=vit_tiny")):
        build_model(compose_config([*DISTILL, "distill.teacher_trunk_kwargs={patch_size: 8, depth: 3, num_heads: 2}"]),
                    3)
    with pytest.raises(DistillError, match="timm cannot build it"):
        build_model(compose_config([*DISTILL, "distill.teacher_trunk=timm:resnet_of_nowhere",
                                    "distill.teacher_trunk_kwargs={}"]), 3)


# ------------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("extra", "message"), [
    (["distill.students=[small_cnn, small_cnn]"], "distill.students names small_cnn twice"),
    (["distill.students=[]"], "distill.students must list at least one student"),
    (["distill.students=[small_cn]"], "small_cn"),
    (["distill.objective=dinov3"], "'distill.objective' = dinov3: use one of feature, dino"),
    (["distill.teacher=/no/such/run"], "'distill.teacher' = /no/such/run: no such file or folder"),
    (["distill.teacher_trunk=vit_tiniest"], "vit_tiniest"),
    (["+model.kwargs.objective=dino"], "'model.kwargs.objective' is the builder's to set for a distillation (from "
                                       "distill.objective)"),
    (["model.trunk=resnet18"], "'model.trunk' = resnet18, but a distillation's model.trunk is its first student's"),
    (["distill.teacher_blocks=0"], "'distill.teacher_blocks' must be >= 1"),
    (["distill.objective=dino", "distill.teacher_blocks=2"], "'distill.teacher_blocks' = 2: the dino objective"),
    (["distill.mask_student=yes"], "distill.mask_student"),
])
def test_bad_distillation_settings_are_config_errors_naming_the_key(extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_config([*DISTILL, *extra])


def test_distill_keys_for_another_method_and_a_missing_teacher_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=re.escape("'distill.objective' is set, but method.name=simclr does not")):
        compose_config(["config=simclr", *SMALL, "distill.objective=dino"])
    with pytest.raises(ConfigError, match=re.escape("'distill.teacher' must be given")):
        compose_config(["config=distill", *SMALL])


def test_what_cannot_be_matched_is_said_when_the_model_is_built(tmp_path: Path) -> None:
    # released weights have no DINO head; a student of another patch size cannot match the iBOT patches
    with pytest.raises(DistillError, match=re.escape("has no DINO head, and distill.objective=dino")):
        build_model(compose_config([*DISTILL, "distill.objective=dino"]), in_channels=3)
    teacher = _dino_teacher()
    with pytest.raises(DistillError, match="vit has 4 px patches and the teacher 8 px"):
        build_distill(teacher=teacher, students={"vit": _vit(patch=4)}, objective="dino")
    mapless = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 8))
    mapless.out_dim = 8  # type: ignore[assignment]
    with pytest.raises(DistillError, match="has no feature map, and the feature objective's dense term"):
        build_distill(teacher=FrozenTeacher(_vit(), source="t"), students={"mlp": mapless})
    model = build_distill(teacher=FrozenTeacher(_vit(), source="t"), students={"mlp": mapless}, dense=False)
    assert model([torch.randn(2, 3, 32, 32)])["students"]["mlp"].patch_pred is None
    with pytest.raises(DistillError, match=re.escape("distill.students names a twice")):
        student_specs(["a", {"trunk": "small_cnn", "name": "a"}])


def test_what_does_not_fit_stops_the_cli_before_the_run_folder_is_written(tmp_path: Path) -> None:
    """The launcher builds the distillation once before it writes anything: a teacher file of another architecture
    (3 blocks where the trunk has 2) is exit 2 with the message, and no run folder."""
    out = tmp_path / "run"
    proc = run_main(*DISTILL, "distill.teacher_trunk_kwargs={patch_size: 8, depth: 3, num_heads: 2}",
                    f"output_dir={out}", check=False)
    assert proc.returncode == 2 and "is another network than distill.teacher_trunk" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_a_vit_student_takes_the_data_presets_image_size_and_its_own_kwargs() -> None:
    """As model.trunk does: the student's position grid is the data's 32 px over its own 8 px patches."""
    cfg = compose_config([*DISTILL, "distill.students=[{trunk: vit_tiny, trunk_kwargs: {patch_size: 8, depth: 1}}]"])
    model = build_model(cfg, in_channels=3)
    assert model.trunk.patch_size == 8 and model.trunk.base_grid == (4, 4) and len(model.trunk.blocks) == 1
