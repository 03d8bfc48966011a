"""Install sslkit: ``pip install -e ".[test]"``."""

from setuptools import find_packages, setup

setup(
    name="sslkit",
    version="0.1.0",
    description="Hook-based self-supervised learning for images, in the shape of VISSL, for today's PyTorch.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["sslkit", "sslkit.*"]),
    package_data={"sslkit": ["config/*.yaml"]},
    install_requires=[
        "torch>=2.2",
        "torchvision>=0.19",  # decode_jpeg of a list of images on the device (data.decode_on=device)
        "timm>=1.0.30",  # the ViT trunks (timm's VisionTransformer; Eva's RoPE augmentation, DINOv3, came in 1.0.30)
        "fvcore>=0.1.5",
        "iopath>=0.1.9",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "tensorboard>=2.12",
        "tqdm>=4.60",
        "numpy>=1.23",
        "pillow>=9.0",
        "safetensors>=0.4",  # sslkit export: the weights format model libraries load without running code
        "matplotlib>=3.7",  # sslkit report's PNG plots (the Agg backend: no display needed)
    ],
    extras_require={
        "test": ["pytest>=7.0", "pytest-xdist>=3.0", "ruff>=0.4", "submitit>=1.5.4", "onnx>=1.16", "onnxruntime>=1.18",
                 "onnxscript>=0.1", "wandb>=0.17", "mlflow>=2.12", "umap-learn>=0.5", "scikit-learn>=1.3",
                 "datasets>=2.16", "webdataset>=0.2", "tifffile>=2023.1", "s3fs>=2024.6", "aiohttp>=3.9",
                 "moto[server]>=5.0", "transformers>=4.56", "peft>=0.13"],
        # model.lora.rank > 0: LoRA adapters on the trunk through peft (docs/adapt.md)
        "lora": ["peft>=0.13"],
        # launcher=slurm submits jobs through submitit (docs/distributed.md)
        "slurm": ["submitit>=1.5.4"],
        # sslkit export format=onnx writes the trunk with torch.onnx's exporter (onnxscript) and checks it with
        # onnxruntime before writing (docs/evaluation.md)
        "onnx": ["onnx>=1.16", "onnxruntime>=1.18", "onnxscript>=0.1"],
        # log.wandb.enabled / log.mlflow.enabled: the run's metrics in Weights & Biases or MLflow (docs/report.md)
        "wandb": ["wandb>=0.17"],
        "mlflow": ["mlflow>=2.12"],
        # sslkit viz kind=embedding draws a UMAP map with umap-learn (a PCA map without it), docs/evaluation.md
        "viz": ["umap-learn>=0.5"],
        # data=hf: Hugging Face datasets on local disk (docs/data.md)
        "hf": ["datasets>=2.16"],
        # data=webdataset: tar shards (brace patterns through webdataset's braceexpand; docs/data.md)
        "webdataset": ["webdataset>=0.2"],
        # remote data (s3://, https://) through fsspec: s3fs for S3 and its kin, aiohttp for HTTP (docs/data.md); gs://
        # needs gcsfs as well
        "remote": ["fsspec>=2024.6", "s3fs>=2024.6", "aiohttp>=3.9", "braceexpand>=0.1.7"],
        # TIFF images of any channel count and 16 bits in a folder or file list (docs/data.md); without it PIL reads
        # the 8-bit TIFFs of 1 or 3 channels
        "tiff": ["tifffile>=2023.1"],
        # benchmarks/throughput.py --tools times kornia's augmentation against sslkit's (docs/data.md)
        "bench": ["kornia>=0.8"],
    },
    entry_points={"console_scripts": ["sslkit = sslkit.launch.cli:console"]},
)
