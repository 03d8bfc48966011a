"""Config composition: groups, overrides, imports, and an error that names the fix for each mistake."""

from __future__ import annotations

import sys
import textwrap

import pytest

from sslkit.config.compose import ConfigError, compose_config, schema


def test_defaults_compose_to_simclr_on_fashion_mnist() -> None:
    cfg = compose_config([])
    assert cfg.loss.name == "nt_xent"
    assert cfg.data.train.source == "fashion_mnist"
    assert cfg.name == "simclr-fashion_mnist"
    assert cfg.output_dir == "runs/simclr-fashion_mnist"


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

            def forward(self, output, sample):
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


def test_sync_bn_without_cuda_is_refused(monkeypatch) -> None:
    import sslkit.config.compose as compose

    monkeypatch.setattr(compose, "_cuda_available", lambda: False)
    with pytest.raises(ConfigError, match=r"'distributed.sync_bn' needs CUDA"):
        compose_config(["distributed.sync_bn=true"])
