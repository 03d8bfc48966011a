"""Config composition: groups, overrides, imports, and an error that names the fix for each mistake."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import MAE_VIT_S16_224, REPO
from omegaconf import OmegaConf, open_dict

from sslkit.config.compose import compose_config
from sslkit.config.schema import ConfigError, schema


def test_defaults_compose_to_simclr_on_fashion_mnist() -> None:
    cfg = compose_config([])
    assert cfg.loss.name == "nt_xent"
    assert cfg.data.train.source == "fashion_mnist"
    assert cfg.name == "simclr-fashion_mnist"
    assert cfg.output_dir == "runs/simclr-fashion_mnist"


def test_a_default_folder_carries_the_overrides_that_change_what_trains() -> None:
    """The README's and docs' commands each get their own folder; the same command (in any order of its
    overrides) the same one; a longer run, another device, other logging or evaluation keep the folder."""
    def folder(*args: str) -> str:
        return str(compose_config(["config=simclr", *args]).output_dir)

    assert folder() == "runs/simclr-fashion_mnist"
    assert folder("optim.epochs=20", "data.batch_size=512") == "runs/simclr-fashion_mnist-data.batch_size=512"
    assert folder("data.batch_size=512", "optim.epochs=40") == folder("optim.epochs=20", "data.batch_size=512")
    assert folder("model.trunk=vit_tiny") == "runs/simclr-fashion_mnist-model.trunk=vit_tiny"
    assert folder("optim.max_steps=10", "machine.device=cpu", "data.num_workers=0", "log.every_n_steps=5",
                  "eval.knn.k=20", "checkpoint.keep_last=1") == "runs/simclr-fashion_mnist"
    assert folder("optim.lr=0.1", "loss.temperature=0.2") == \
        "runs/simclr-fashion_mnist-loss.temperature=0.2-optim.lr=0.1"
    assert folder("model.head={name: mlp, out_dim: 64}") == "runs/simclr-fashion_mnist-model.head=_name_mlp,_out_dim_64"
    long = folder("model.head={name: mlp, out_dim: 64, hidden_dim: 2048}", "optim.lr=0.1", "optim.weight_decay=0.001")
    other = folder("model.head={name: mlp, out_dim: 64, hidden_dim: 1024}", "optim.lr=0.1", "optim.weight_decay=0.001")
    assert len(long) == len("runs/simclr-fashion_mnist") + 64 and long != other  # cut, with a hash of the whole
    assert folder("name=mine", "optim.lr=0.1") == "runs/mine"
    assert folder("output_dir=/tmp/x", "optim.lr=0.1") == "/tmp/x"


@pytest.mark.parametrize("recipe", ["dino_vit", "ibot", "dinov2", "dinov3", "ijepa", "mae", "lejepa", "mocov3_vit",
                                    "simclr_vit"])
def test_a_fashion_mnist_vit_recipe_on_large_images_stops_and_names_what_to_run(recipe: str, tmp_path) -> None:
    """config=dino_vit data=folder trained 224 px crops in 7 px patches (1024 tokens, 17 s a step) and 14 px local
    crops, the recipe's sizes winning over the preset's: it stops instead, naming the paper-scale recipes and the
    preset's sizes; with the sizes set, or sized_for=null, it composes; on its own data and on CIFAR's 32 px it is
    left alone."""
    (tmp_path / "a.jpg").touch()  # the folder check looks for an image file
    folder = ["data=folder", f"data.train.path={tmp_path}", "machine.device=cpu"]
    with pytest.raises(ConfigError) as info:
        compose_config([f"config={recipe}", *folder])
    text = str(info.value)
    assert "'sized_for' = 28" in text and "data.image_size is 224" in text
    assert "model.trunk_kwargs.patch_size=16" in text
    assert "config=" + {"dinov2": "dinov2_vits16", "ibot": "ibot_vits16", "ijepa": "ijepa_vits16",
                        "dinov3": "dinov3_vits16"}.get(
        recipe, "dinov2_vits16") in text
    patch = compose_config([f"config={recipe}"]).model.trunk_kwargs.patch_size
    assert f"{(224 // patch) ** 2} tokens" in text
    multi = compose_config([f"config={recipe}"]).data.transform.get("num_small")
    assert ("data.small_image_size=96" in text) == bool(multi)
    sized = compose_config([f"config={recipe}", *folder, "model.trunk_kwargs.patch_size=16",
                            *(["data.small_image_size=96"] if multi else [])])
    assert sized.model.trunk_kwargs.patch_size == 16
    assert compose_config([f"config={recipe}", *folder, "sized_for=null"]).model.trunk_kwargs.patch_size == patch
    assert compose_config([f"config={recipe}"]).sized_for == 28


@pytest.mark.parametrize("recipe", ["dino_vit", "ibot", "dinov2", "dinov3", "ijepa", "mae", "lejepa", "mocov3_vit",
                                    "simclr_vit"])
@pytest.mark.parametrize("data", ["wild", "studio", "cifar10"])
def test_a_fashion_mnist_vit_recipe_on_32_px_images_keeps_its_token_grids(recipe: str, data: str) -> None:
    """At 32 px (the wild set's and CIFAR's), a recipe sized for 28 px scales the patches that do not divide 32 and
    its local crops by 32 / 28 (7 -> 8, 14 -> 16: the same 4 x 4 and 2 x 2 grids); patches that divide 32 (MAE's
    and I-JEPA's 4) stay; a patch size the command gives is kept, and checked, as given."""
    own = compose_config([f"config={recipe}"])
    cfg = compose_config([f"config={recipe}", f"data={data}"])
    patch, small = own.model.trunk_kwargs.patch_size, own.data.get("small_image_size")
    if patch == 7:
        assert cfg.model.trunk_kwargs.patch_size == 8
        assert cfg.data.image_size // 8 == own.data.image_size // 7
        if own.data.transform.get("num_small"):
            assert (cfg.data.small_image_size, small) == (16, 14)
            assert cfg.data.transform.small_size == 16 and cfg.data.small_image_size // 8 == small // 7
        with pytest.raises(ConfigError, match="not a multiple of the ViT's patch size 7"):
            compose_config([f"config={recipe}", f"data={data}", "model.trunk_kwargs.patch_size=7"])
    else:
        assert cfg.model.trunk_kwargs.patch_size == patch and 32 % patch == 0
    assert compose_config([f"config={recipe}", f"data={data}", "model.trunk_kwargs.patch_size=2"]
                          ).model.trunk_kwargs.patch_size == 2


def test_required_keys_exist() -> None:
    keys = [
        "output_dir", "seed", "machine.device", "train_step", "hooks", "imports", "data.train.source",
        "data.train.path", "data.batch_size", "data.num_workers", "data.limit", "model.trunk", "optim.name",
        "optim.lr", "optim.epochs", "optim.max_steps", "amp.enabled", "amp.dtype", "checkpoint.every_n_epochs",
        "checkpoint.every_n_steps", "checkpoint.auto_resume", "log.every_n_steps", "eval.knn.enabled",
        "distributed.nproc_per_node",
    ]
    s = schema()
    from omegaconf import OmegaConf

    for key in keys:
        assert OmegaConf.select(s, key, default="MISSING") != "MISSING", key


def test_group_choice_and_overrides() -> None:
    cfg = compose_config(["data=cifar10", "optim.lr=0.05", "model.trunk=resnet18", "optim.betas=[0.8,0.9]"])
    assert cfg.data.train.source == "cifar10"
    assert cfg.data.transform.image_size == 32
    assert cfg.optim.lr == 0.05
    assert list(cfg.optim.betas) == [0.8, 0.9]
    assert cfg.name == "simclr-cifar10"


def test_unknown_key_names_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr'.*Did you mean 'optim.lr'"):
        compose_config(["optim.lrr=0.1"])


@pytest.mark.parametrize(("recipe", "old", "new"), [
    ("dinov3", "gram.start_update=5", "unknown config key 'gram.start_update'. It was renamed 'gram.start_step'"),
    ("dinov3", "hires.start_update=5", "It was renamed 'hires.start_step'"),
    ("dinov3", "gram.ramp_updates=5", "It was renamed 'gram.ramp_steps'"),
    ("simclr", "optim.accumulate_steps=2", "It was renamed 'optim.micro_batches'"),
    ("dino", "loss.warmup_teacher_temp_iters=3", "It was renamed 'warmup_teacher_temp_steps'"),
    ("swav", "loss.queue_start_iter=3", "It was renamed 'queue_start_step'"),
    ("swav", "method.hooks.swav_prototypes={freeze_prototypes_iters: 3}", "It was renamed 'freeze_prototypes_steps'"),
    ("dino_vit", "model.freeze=[{params: 'head.*', updates: 3}]",
     "'model.freeze[0].updates' was renamed 'model.freeze[0].steps'"),
])
def test_a_renamed_key_stops_with_its_new_name(recipe: str, old: str, new: str) -> None:
    """One word per counter (a step is an optimizer update): each old name stops the config with the new one, which
    docs/configs.md lists."""
    with pytest.raises(ConfigError, match=re.escape(new)):
        compose_config([f"config={recipe}", "machine.device=cpu", old])
    renamed = new.split("renamed '")[1].rstrip("'").split(".")[-1]
    assert renamed in (REPO / "docs" / "configs.md").read_text()


def test_added_unknown_key_is_rejected_with_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'data.batchsize'.*Did you mean 'data.batch_size'"):
        compose_config(["+data.batchsize=3"])


def test_unknown_group_option_names_closest() -> None:
    with pytest.raises(ConfigError, match=r"config=simclrr.*Did you mean 'simclr'.*Available: .*simclr"):
        compose_config(["config=simclrr"])


def test_wrong_type_names_key() -> None:
    with pytest.raises(ConfigError, match=r"'data.batch_size' must be int.*got str 'abc'"):
        compose_config(["data.batch_size=abc"])
    with pytest.raises(ConfigError, match=r"'amp.enabled' must be bool"):
        compose_config(["amp.enabled=3"])


def test_int_accepted_for_float() -> None:
    assert compose_config(["optim.lr=1"]).optim.lr == 1


def test_impossible_values_name_key() -> None:
    with pytest.raises(ConfigError, match=r"'data.batch_size' must be > 0, got -4"):
        compose_config(["data.batch_size=-4"])
    with pytest.raises(ConfigError, match=r"both 0"):
        compose_config(["optim.epochs=0"])
    with pytest.raises(ConfigError, match=r"'optim.name' must be one of"):
        compose_config(["optim.name=sgdd"])


def test_unknown_registry_names_name_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown trunk 'resnet19'.*Did you mean 'resnet18'"):
        compose_config(["model.trunk=resnet19"])
    with pytest.raises(ConfigError, match=r"unknown train_step 'standrd'.*Did you mean 'standard'"):
        compose_config(["train_step=standrd"])
    with pytest.raises(ConfigError, match=r"unknown dataset 'fashion_mnst'.*Did you mean 'fashion_mnist'"):
        compose_config(["data.train.source=fashion_mnst"])
    with pytest.raises(ConfigError, match=r"unknown hook 'nope'"):
        compose_config(["hooks=[{name: nope}]"])


def test_builder_kwargs_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"'loss.temprature' is not an argument.*Did you mean 'temperature'"):
        compose_config(["+loss.temprature=0.2"])
    with pytest.raises(ConfigError, match=r"'model.head.out_dimm' is not an argument.*Did you mean 'out_dim'"):
        compose_config(["+model.head.out_dimm=3"])


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        compose_config(["optim.lr"])


def test_imports_registers_user_components(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_ssl_plugin.py").write_text(textwrap.dedent('''
        from sslkit.registry import register_loss
        import torch

        @register_loss("plugin_loss_for_compose_test")
        class PluginLoss(torch.nn.Module):
            def __init__(self, scale: float = 1.0):
                super().__init__()
                self.scale = scale

            def forward(self, output, sample, ctx=None):
                return self.scale * output["projections"][0].pow(2).mean()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="unknown loss"):
        compose_config(["loss={name: plugin_loss_for_compose_test}"])
    cfg = compose_config(["imports=[my_ssl_plugin]", "loss={name: plugin_loss_for_compose_test, scale: 2.0}"])
    assert cfg.loss.scale == 2.0
    assert "my_ssl_plugin" in sys.modules


def test_missing_import_module() -> None:
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_xyz'"):
        compose_config(["imports=[no_such_module_xyz]"])


def test_sync_bn_on_cpu_is_accepted() -> None:
    """sslkit's own SyncBatchNorm runs on CPU / gloo (torch's fused one on CUDA)."""
    cfg = compose_config(["distributed.sync_bn=true", "machine.device=cpu"])
    assert cfg.distributed.sync_bn is True and cfg.machine.device == "cpu"


@pytest.mark.parametrize(("overrides", "expected"), [
    (["data.batch_size=-4"], r"'data.batch_size' must be > 0, got -4"),
    (["data.batch_size=0"], r"'data.batch_size' must be > 0, got 0"),
    (["optim.epochs=0"], r"'optim.epochs' and 'optim.max_steps' are both 0"),
    (["optim.lr=-0.1"], r"'optim.lr' must be > 0 and finite, got -0.1"),
    (["optim.lr=inf"], r"'optim.lr' must be > 0 and finite, got inf"),
    (["optim.momentum=1.5"], r"'optim.momentum' must be in \[0, 1\)"),
    (["optim.betas=[0.9,1.5]"], r"'optim.betas' must be two numbers in \[0, 1\), got \[0.9, 1.5\]"),
    (["optim.betas=[a,b]"], r"'optim.betas' must be two numbers"),
    (["data.min_crop_scale=0"], r"'data.min_crop_scale' must be in \(0, 1\]"),
    (["eval.knn.batch_size=0"], r"'eval.knn.batch_size' must be > 0"),
    (["distributed.master_port=70000"], r"'distributed.master_port' must be a TCP port"),
])
def test_impossible_values_are_refused_naming_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        compose_config(overrides)


def test_epochs_zero_is_fine_when_max_steps_decides() -> None:
    assert compose_config(["optim.epochs=0", "optim.max_steps=5"]).optim.max_steps == 5


@pytest.mark.parametrize(("overrides", "expected"), [
    # Fashion-MNIST is 28x28: a 64 crop (training and eval transforms both use data.image_size) does not fit
    (["data.image_size=64"], r"'data.image_size' = 64: a crop larger than the 28x28 images of the train split "
                             r"\(source fashion_mnist\) does not fit the image. Set data.image_size <= 28"),
    (["data=cifar10", "data.image_size=40"], r"'data.image_size' = 40: .* 32x32 images .* <= 32"),
    (["data=synthetic", "data.train.kwargs.image_size=16"], r"'data.image_size' = 32: .* 16x16 images .*synthetic"),
    # the test split is built with data.test.kwargs: its synthetic images are 32x32 unless set there too
    (["data=synthetic", "data.train.kwargs.image_size=64", "data.image_size=64"],
     r"'data.image_size' = 64: .* 32x32 images of the test split \(source synthetic\)"),
    (["data.eval_transform.image_size=29"], r"'data.eval_transform.image_size' = 29: .* 28x28"),
    (["config=swav", "data.small_image_size=40"], r"'data.small_image_size' = 40: .* 28x28"),
    (["config=swav", "data=cifar10", "data.image_size=16", "data.small_image_size=20"],
     r"'data.small_image_size' = 20: the local crops \(data.transform.small_size\) must not be larger than the "
     r"global crops \(data.transform.image_size = 16\)"),
    # (the preset's crop_pct resizes to 342 for a 300 crop: an explicit resize must hold the crop)
    (["data=folder", "data.train.path=/", "data.image_size=300", "data.eval_transform.resize=256"],
     r"'data.image_size' = 300: the centre crop of data.eval_transform must fit .*'data.eval_transform.resize' = 256"),
    (["data.transform.crop_scale=[0.5,0.2]"], r"'data.transform': crop_scale must satisfy 0 < lo <= hi <= 1"),
    (["data.transform.blur_p=2"], r"'data.transform': blur_p must be a probability"),
    (["data.transform.mean=[0.5,0.5,0.5]"], r"'data.transform.mean' has 3 values but the images of the train "
                                            r"split \(source fashion_mnist\) have 1 channel"),
])
def test_transforms_that_do_not_fit_the_images_are_refused(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        compose_config(overrides)


def test_a_shared_crop_key_is_reported_once() -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["data.image_size=64"])
    assert str(info.value).count("'data.image_size'") == 1


def test_crops_that_fit_are_accepted() -> None:
    assert compose_config(["data.image_size=28"]).data.transform.image_size == 28  # exactly the image
    assert compose_config(["data=folder", "data.train.path=/", "data.image_size=256"]).data.image_size == 256
    cfg = compose_config(["data=synthetic", "data.train.kwargs.image_size=64", "data.test.kwargs.image_size=64",
                          "data.image_size=64"])
    assert cfg.data.eval_transform.image_size == 64


def test_the_gpu_tests_paper_scale_configs_compose_here() -> None:
    """tests/gpu runs only where a GPU is lent: its configs are checked on every machine, so a new check of the
    config cannot refuse them unseen (the 224 px MAE test did, until the test split's size was set too)."""
    cfg = compose_config([*MAE_VIT_S16_224, "amp.enabled=true", "amp.dtype=bfloat16"])  # (the device: here)
    assert (cfg.data.image_size, cfg.data.patch_size, cfg.data.eval_transform.image_size) == (224, 16, 224)


def test_folder_paths_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'data.train.path' must be set for the folder source"):
        compose_config(["data=folder"])
    with pytest.raises(ConfigError, match=rf"'data.train.path' = {tmp_path}/nope: does not exist"):
        compose_config(["data=folder", f"data.train.path={tmp_path}/nope"])
    (tmp_path / "notes.txt").write_text("a file")
    with pytest.raises(ConfigError, match=r"'data.test.path' = .*notes.txt: is a file, not a folder"):
        compose_config(["data=folder", f"data.train.path={tmp_path}", f"data.test.path={tmp_path}/notes.txt"])
    # a folder without an image file anywhere below it stops here, before the run folder is made
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.gif").write_bytes(b"GIF89a")
    with pytest.raises(ConfigError, match=rf"'data.train.path' = {tmp_path}: no image files in the folder or below "
                                          r"it \(extensions .jpg, .jpeg, .png"):
        compose_config(["data=folder", f"data.train.path={tmp_path}"])
    (tmp_path / "sub" / "x.JPG").touch()
    assert compose_config(["data=folder", f"data.train.path={tmp_path}"]).data.test.path is None
    # an explicit Fashion-MNIST path that does not exist is an error, not a silent fall back to the system copy
    with pytest.raises(ConfigError, match=rf"'data.train.path' = {tmp_path}/nope: does not exist; give the folder"):
        compose_config([f"data.train.path={tmp_path}/nope"])
    assert compose_config([f"data.train.path={tmp_path}"]).data.train.path == str(tmp_path)


def test_no_step_per_epoch_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'data.batch_size' = 256: a step takes 256 .* more than the 100 training "
                                          r"samples \(data.limit=100\).*raise data.limit"):
        compose_config(["data.limit=100"])
    with pytest.raises(ConfigError, match=r"'data.batch_size' = 16: a step takes 16 x 2 process\(es\) .* 32 samples, "
                                          r"more than the 24 training samples \(data.train.kwargs.num_samples=24\)"):
        compose_config(["data=synthetic", "data.train.kwargs.num_samples=24", "data.batch_size=16",
                        "machine.device=cpu", "distributed.nproc_per_node=2"])
    assert compose_config(["data.limit=256"]).data.limit == 256


def test_builder_argument_types_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"'data.transform.image_size' must be int, got str 'abc'"):
        compose_config(["data.transform.image_size=abc"])
    with pytest.raises(ConfigError, match=r"'loss.temperature' must be float, got str 'warm'"):
        compose_config(["loss.temperature=warm"])
    with pytest.raises(ConfigError, match=r"'data.eval_transform.resize' must be int \| None, got number 2.5"):
        compose_config(["data.eval_transform.resize=2.5"])
    assert compose_config(["loss.temperature=1"]).loss.temperature == 1  # an int where a float belongs


@pytest.mark.parametrize("recipe", ["barlow_twins", "byol", "dino", "moco", "mocov3", "simclr", "simsiam", "swav",
                                    "vicreg"])
def test_every_recipe_composes_on_its_default_data(recipe: str) -> None:
    assert compose_config([f"config={recipe}"]).name == f"{recipe}-fashion_mnist"


@pytest.mark.parametrize("data", ["cifar10", "cifar100", "fashion_mnist", "folder", "synthetic"])
def test_multicrop_recipe_composes_on_every_data_preset(data: str, tmp_path: Path) -> None:
    (tmp_path / "a.jpg").touch()  # the folder check looks for an image file
    cfg = compose_config(["config=swav", f"data={data}", f"data.train.path={tmp_path}"])
    assert cfg.data.transform.small_size < cfg.data.transform.image_size


def test_cli_bad_config_exits_2_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import run_main

    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    proc = run_main("data.batch_size=-4", "data.image_size=64", f"output_dir={out}", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "sslkit: config error" in proc.stderr
    assert "'data.batch_size' must be > 0, got -4" in proc.stderr and "Set data.image_size <= 28" in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nor runs/ in the working folder


@pytest.mark.parametrize("overrides, message", [
    (["config=simclr", "distributed.strategy=fsdp"],
     r"'distributed.strategy' = fsdp shards a model one transformer block at a time, and model.trunk=small_cnn has "
     r"none: use distributed.strategy=ddp"),
    (["config=simclr", "model.activation_checkpointing=true"],
     r"'model.activation_checkpointing' = true checkpoints transformer blocks.*set model.activation_checkpointing="
     r"false or use a ViT trunk"),
    (["config=mae", "distributed.strategy=fsdp", "amp.enabled=true", "amp.dtype=float16"],
     r"'amp.dtype' = float16 under distributed.strategy=fsdp.*use amp.dtype=bfloat16"),
    (["config=mae", "distributed.strategy=fsdp", "reliability.oom=skip"],
     r"'reliability.oom' = skip.*use reliability.oom=halt with distributed.strategy=fsdp"),
    (["config=mae", "distributed.strategy=fsdp", "distributed.manual_gradient_reduction=true"],
     r"'distributed.manual_gradient_reduction' = true is DDP's option"),
    (["config=mae", "distributed.strategy=zero3"], r"'distributed.strategy' must be ddp or fsdp"),
])
def test_what_fsdp_cannot_take_is_refused_with_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_fsdp_accepts_a_vit_recipe_with_bf16_and_checkpointing() -> None:
    cfg = compose_config(["config=dinov2", "distributed.strategy=fsdp", "amp.enabled=true",
                          "model.activation_checkpointing=true"])
    assert cfg.distributed.strategy == "fsdp" and cfg.model.activation_checkpointing


def test_global_batch_must_split_over_the_processes_and_micro_batches() -> None:
    from sslkit.config.rules import per_process_batch

    args = ["config=simclr", "machine.device=cpu", "distributed.nproc_per_node=3", "optim.micro_batches=2"]
    with pytest.raises(ConfigError, match=r"'data.global_batch_size' = 100 does not split over 3 process\(es\) x "
                                          r"optim.micro_batches=2 = 6 micro-batches: set it to a multiple of 6 "
                                          r"\(96 or 102\)"):
        compose_config([*args, "data.global_batch_size=100"])
    cfg = compose_config([*args, "data.global_batch_size=96"])
    assert per_process_batch(cfg, 3) == 16 and per_process_batch(cfg, 1) == 48
    assert per_process_batch(compose_config(args), 3) == cfg.data.batch_size  # 0: data.batch_size per process
    # more images per step than the data holds: the message names the key the user set
    with pytest.raises(ConfigError, match=r"'data.global_batch_size' = 96: a step takes 16 x 3 process\(es\) x "
                                          r"optim.micro_batches=2 = 96 samples.*Lower data.global_batch_size"):
        compose_config([*args, "data.global_batch_size=96", "data=synthetic", "data.train.kwargs.num_samples=64"])


def test_a_composition_is_reused_only_while_its_files_are_unchanged(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A process composes the same recipe again from memory (a run composes its recipe twice; tests, doctor and
    audit many times), but a recipe file edited in between is read again, and what a caller changes in one
    composition is not in the next."""
    from sslkit.config import schema

    recipe = tmp_path / "config" / "mine.yaml"
    recipe.parent.mkdir()
    recipe.write_text("# @package _global_\ndefaults:\n  - simclr\n  - _self_\noptim:\n  lr: 0.25\n")
    monkeypatch.setattr(schema, "CONFIG_DIRS", [*schema.CONFIG_DIRS, tmp_path])
    first = compose_config(["config=mine", "machine.device=cpu"])
    assert first.optim.lr == 0.25
    with open_dict(first):
        first.optim.lr = 9.0
        first.extra = 1
    again = compose_config(["config=mine", "machine.device=cpu"])
    assert again.optim.lr == 0.25 and "extra" not in again
    recipe.write_text(recipe.read_text().replace("0.25", "0.125"))
    assert compose_config(["config=mine", "machine.device=cpu"]).optim.lr == 0.125
    assert compose_config(["config=simclr", "machine.device=cpu"]).optim.lr != 0.125  # keyed by the recipe
    # reused by the choices made, whatever their order or repetition (Hydra takes the last of a group, as here)
    a = compose_config(["data=synthetic", "config=mine", "machine.device=cpu"])
    b = compose_config(["config=simclr", "machine.device=cpu", "config=mine", "data=synthetic"])
    assert a.optim.lr == b.optim.lr == 0.125 and a.data.train.source == "synthetic" and a == b


def test_every_key_that_defaults_to_auto_has_a_value_rule() -> None:
    """A key defaulting to auto is not type-checked (it takes auto or a value of another type): the value table
    checks it, or, in a section a method owns (Method.sections), that method's rules."""
    import sslkit.methods  # noqa: F401  (registrations)
    from sslkit import registry as R
    from sslkit.config.schema import flat_keys, schema
    from sslkit.config.values import VALUE_RULES

    owned = [path for _, method in R.METHODS for path in method.sections]
    ref = schema()
    auto = [k for k in flat_keys(ref) if OmegaConf.select(ref, k) == "auto"]
    assert "machine.device" in auto and "distill.teacher_shard" in auto
    loose = [k for k in auto if k not in VALUE_RULES and not any(k == p or k.startswith(p + ".") for p in owned)]
    assert not loose, f"keys defaulting to auto without a value rule: {loose}"
    with pytest.raises(ConfigError, match=re.escape("'eval.bench.robustness.table' must be auto, imagenet or cifar")):
        compose_config(["eval.bench.robustness.table=cifar10"])
    with pytest.raises(ConfigError, match=re.escape("'distill.teacher_shard' must be auto, true or false")):
        compose_config(["config=distill", "distill.teacher=.", "distill.teacher_shard=maybe"])


def test_a_data_presets_trunk_arguments_go_with_its_trunk_not_into_a_recipes_own() -> None:
    """data=cifar10 suits the CNN recipes with resnet18 and its 3x3 stem; a ViT recipe keeps its own trunk and
    arguments (the stem argument was merged into them: every ViT recipe stopped on CIFAR), and the command's own
    setting is still the user's to make, and checked."""
    assert dict(compose_config(["config=simclr", "data=cifar10"]).model.trunk_kwargs) == {"small_image_stem": True}
    for recipe in ("dino_vit", "mae", "dinov3"):
        cfg = compose_config([f"config={recipe}", "data=cifar10"])
        own = compose_config([f"config={recipe}"])
        assert (cfg.model.trunk, set(cfg.model.trunk_kwargs)) == (own.model.trunk, set(own.model.trunk_kwargs))
    with pytest.raises(ConfigError, match=re.escape("'model.trunk_kwargs.small_image_stem' is not an argument")):
        compose_config(["config=dino_vit", "data=cifar10", "model.trunk_kwargs.small_image_stem=true"])
