"""Loading and converting a released ViT-L file into sslkit's trunk, against transformers' and plain PyTorch's loaders.

    python benchmarks/weights_load.py [--repeats 3]

A DINOv3 ViT-L/16 in transformers' layout (``DINOv3ViTModel`` of the released ViT-L's config: 24 blocks, 1024 wide,
16 heads, 4 registers, 300M parameters; random weights, ``save_pretrained`` into a temporary folder: the same bytes
and names as a downloaded release) is read three ways, each ``--repeats`` times in this process, the fastest kept
(the file in the page cache after the first):

* **sslkit, transformers' folder**: :func:`sslkit.models.weights.load_trunk` into the trunk that
  :func:`~sslkit.models.hf_weights.hf_trunk` builds from its config.json (timm's DINOv3 ViT at the file's shape):
  safetensors read, q/k/v joined, names converted, every tensor accounted for, copied into the trunk;
* **sslkit, timm's layout**: the same trunk's own state as one safetensors file (what ``sslkit export`` writes), read
  by the same call;
* **baselines**: ``transformers.AutoModel.from_pretrained(DIR)``, and plain PyTorch's ``load_state_dict`` of
  safetensors' ``load_file`` of that file into a fresh trunk of the same shape (``strict=True``).

The build of each network (random initialisation) is left out of every figure: only reading and converting count.
Issue 65 asks for a ViT-L file under 10 s on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["main"]

#: The released DINOv3 ViT-L/16's shape (facebook/dinov3-vitl16-pretrain-lvd1689m's config.json).
VIT_L = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
         "patch_size": 16, "image_size": 224, "num_register_tokens": 4, "layerscale_value": 1e-5,
         "use_gated_mlp": False, "hidden_act": "gelu"}


def _fastest(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    """Print the four times; exit 0."""
    import timm
    import transformers
    from safetensors.torch import load_file, save_file

    from sslkit.builder.common import trunk_kwargs
    from sslkit.models.hf_weights import hf_config, hf_trunk
    from sslkit.models.weights import load_trunk
    from sslkit.registry import TRUNKS, get

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder, flat = Path(tmp) / "hf", Path(tmp) / "timm.safetensors"
        torch.manual_seed(0)
        transformers.DINOv3ViTModel(transformers.DINOv3ViTConfig(**VIT_L)).save_pretrained(folder)
        name, given = hf_trunk(hf_config(folder))
        builder = get(TRUNKS, name)
        trunk = builder(**trunk_kwargs(builder, given, 3, 224, 16))
        size = sum(p.numel() for p in trunk.parameters())
        hf_s = _fastest(lambda: load_trunk(trunk, folder), args.repeats)
        save_file({k: v.contiguous() for k, v in trunk.state_dict().items()}, str(flat))
        flat_s = _fastest(lambda: load_trunk(trunk, flat), args.repeats)
        auto_s = _fastest(lambda: transformers.AutoModel.from_pretrained(folder), args.repeats)
        plain = builder(**trunk_kwargs(builder, given, 3, 224, 16))
        plain_s = _fastest(lambda: plain.load_state_dict(load_file(str(flat)), strict=True), args.repeats)
        mib = (sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, timm {timm.__version__}, "
          f"{torch.get_num_threads()} threads; {name} at ViT-L's shape, {size / 1e6:.0f}M parameters, {mib:.0f} MiB "
          "file; "
          f"fastest of {args.repeats}")
    print(f"sslkit, transformers' folder -> trunk: {hf_s:6.2f} s   (transformers' AutoModel.from_pretrained: "
          f"{auto_s:6.2f} s, ratio {hf_s / auto_s:.2f})")
    print(f"sslkit, timm's layout file   -> trunk: {flat_s:6.2f} s   (plain load_state_dict of the file:       "
          f"{plain_s:6.2f} s, ratio {flat_s / plain_s:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
