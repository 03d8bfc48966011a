"""Export a trunk as weights for its torchvision (ResNets) or timm (ViTs) twin or as ONNX, with its normalisation."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import torch
from torch import nn

from sslkit.errors import did_you_mean
from sslkit.files import atomic_write
from sslkit.tools.pretrained import Pretrained, ToolError, normalisation

__all__ = ["export_main", "export_onnx", "export_trunk", "export_vit", "timm_twin", "torchvision_twin"]

logger = logging.getLogger("sslkit")

#: sslkit trunks that are torchvision ResNets without their classifier.
_TWINS = {"resnet18": "resnet18", "resnet34": "resnet34", "resnet50": "resnet50", "resnet101": "resnet101"}

#: ``twin=``: what the exported weights must load into.
TWIN_MODES = ("auto", "torchvision", "timm", "none")

#: ``format=``: what is written, and the extensions of each.
FORMATS = {"safetensors": (".safetensors",), "pt": (".pt", ".pth"), "onnx": (".onnx",), "hf": ()}

EXPORT_KEYS = {
    "checkpoint": "a run folder (its latest checkpoint) or a checkpoint file",
    "output": "the file: .safetensors (default <run>/export/encoder.safetensors), .pt or .onnx (default "
              "<run>/export/encoder.onnx with format=onnx)",
    "format": "safetensors | pt (weights) | onnx (the trunk as an ONNX graph, checked with onnxruntime) | hf (a ViT "
              "as a Hugging Face transformers DINOv2 / DINOv3 folder, checked with transformers); default: output's "
              "extension, else safetensors",
    "features": "trunk (default) | teacher (the momentum encoder of BYOL, MoCo, DINO)",
    "twin": "auto (default: torchvision for a ResNet, timm for a ViT) | torchvision (must load strictly into "
            "torchvision.models.<trunk>) | timm (a ViT: must load strictly into timm.create_model(arch, num_classes=0, "
            "**kwargs)) | none (sslkit's own trunk, e.g. small_cnn or the small-image stem; loads into sslkit's trunk "
            "builder); not with format=onnx, whose graph is the architecture",
}


def torchvision_twin(cfg: Any, in_channels: int) -> tuple[str | None, str]:
    """The torchvision model a trunk equals (``resnet50``), or None with what differs."""
    name = str(cfg.model.trunk)
    if name not in _TWINS:
        return None, (f"model.trunk={name} is sslkit's own network, not a torchvision model")
    kwargs = dict(cfg.model.trunk_kwargs)
    if kwargs.get("small_image_stem"):
        return None, (f"{name} with model.trunk_kwargs.small_image_stem=true: its conv1 is 3x3 with stride 1 "
                      "(torchvision: 7x7 stride 2) and it has no max-pool (torchvision: 3x3 stride 2)")
    if in_channels != 3:
        return None, f"{name} on {in_channels}-channel images: its conv1 takes {in_channels} channels (torchvision: 3)"
    return _TWINS[name], ""


def _plain_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state_dict as contiguous, unshared CPU tensors (what safetensors stores), without the prefixes
    ``torch.compile`` (``_orig_mod.``) or DDP (``module.``) may add."""
    out: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        key = key.replace("_orig_mod.", "")  # torch.compile's wrapper, at any depth
        if key.startswith("module."):  # a DDP wrapper, at the top only ("submodule." must stay)
            key = key[len("module."):]
        out[key] = value.detach().to("cpu").contiguous().clone()
    return out


def timm_twin(trunk: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """The timm architecture and keyword arguments of a ViT trunk, such that ``timm.create_model(arch,
    num_classes=0, **kwargs)`` is the same network (``kwargs`` without ``num_classes``, JSON-serialisable);
    None for a trunk that is not timm's (no ``timm_spec``)."""
    spec = getattr(trunk, "timm_spec", None)
    if not callable(spec):
        return None
    arch, kwargs = spec()
    plain = json.loads(json.dumps({k: v for k, v in kwargs.items() if k != "num_classes"},
                                  default=lambda v: list(v) if isinstance(v, tuple) else str(v)))
    return str(arch), plain


def _same_features(ours: nn.Module, theirs: nn.Module, inputs: list[torch.Tensor], what: str) -> None:
    """``ours`` (a float32 CPU copy, in eval mode) and ``theirs`` give the same features on every input (rtol 1e-4,
    atol 1e-5), else a :class:`ToolError` naming ``what``: a bug."""
    ref = copy.deepcopy(ours).to("cpu", torch.float32).eval()
    theirs.eval()
    for x in inputs:
        with torch.no_grad():
            a, b = ref(x).float(), theirs(x).float()
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            diff = (f"max difference {(a - b).abs().max().item():.3g}" if a.shape == b.shape else
                    f"shapes {tuple(a.shape)} and {tuple(b.shape)}")
            raise ToolError(f"the exported weights load into {what} but give other features on a {tuple(x.shape)} "
                            f"input ({diff}): please report this as a bug")


def export_trunk(trunk: nn.Module, twin: str | None) -> dict[str, torch.Tensor]:
    """The trunk's weights; with a ``twin``, checked to load with ``strict=True`` into
    ``torchvision.models.<twin>(weights=None)`` whose ``fc`` is ``nn.Identity()`` and to give the same features
    (to 1e-5 on a random batch, both in eval mode, on the CPU)."""
    state = _plain_state(trunk)
    if twin is None:
        return state
    import torchvision

    model = getattr(torchvision.models, twin)(weights=None)
    model.fc = nn.Identity()
    model.load_state_dict(state, strict=True)
    # compared on the CPU in float32: on CUDA, TF32 convolutions would differ by more than the tolerance
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    _same_features(trunk, model, [x], f"torchvision.models.{twin}")
    return state


#: Parameters of sslkit's ViT that timm's VisionTransformer does not have, with why.
_NOT_IN_TIMM = {"mask_token": "the learned mask token of masked-image methods (iBOT, DINOv2, SimMIM): it replaces "
                              "masked patches during pretraining only, and timm's VisionTransformer has none"}


def export_vit(trunk: nn.Module) -> tuple[dict[str, torch.Tensor], str, dict[str, Any], dict[str, str]]:
    """A ViT trunk's weights for timm: ``(state, arch, kwargs, left_out)``, the state checked to load with
    ``strict=True`` into ``timm.create_model(arch, num_classes=0, **kwargs)`` and to give the same features at the
    trunk's image size and at one patch more (position embeddings resampled), on a float32 CPU copy in eval mode.
    ``left_out``: the parameters timm's model has no place for (the mask token), with why."""
    import timm

    found = timm_twin(trunk)
    if found is None:
        raise ToolError(f"{type(trunk).__name__} is not one of sslkit's ViTs (it has no timm_spec): export it with "
                        "twin=none")
    arch, kwargs = found
    state = _plain_state(trunk)
    left_out = {key: why for key, why in _NOT_IN_TIMM.items() if state.pop(key, None) is not None}
    model = timm.create_model(arch, num_classes=0, **kwargs)
    model.load_state_dict(state, strict=True)
    side, patch = int(kwargs["img_size"]), int(kwargs["patch_size"])
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, int(kwargs.get("in_chans", 3)), s, s, generator=g) for s in (side, side + patch)]
    _same_features(trunk, model, inputs, f"timm.create_model('{arch}', num_classes=0, **kwargs)")
    return state, arch, kwargs, left_out


# ---------------------------------------------------------------------------------------------------------------------
# ONNX
# ---------------------------------------------------------------------------------------------------------------------

#: The ONNX graph's input and output names.
ONNX_INPUT, ONNX_OUTPUT = "pixels", "features"
#: onnxruntime's features must equal PyTorch's elementwise to ``ONNX_ATOL + ONNX_RTOL * |PyTorch's|`` (measured
#: differences, float32 on the CPU: below 6e-6 for small_cnn, ResNet-18/50 and ViT-Tiny/Small/Base, docs/evaluation.md).
ONNX_ATOL, ONNX_RTOL = 1e-4, 1e-3
#: The batch size the graph is traced with, and those it is checked with (the batch axis is dynamic).
_TRACED_BATCH, _CHECKED_BATCHES = 2, (1, 5)
#: Weights above this many bytes go to a ``<file>.data`` next to the graph (a protobuf file holds at most 2 GiB).
_ONNX_SINGLE_FILE_BYTES = 1536 * 2**20


def _onnx_modules() -> tuple[Any, Any]:
    """``(onnx, onnxruntime)``; one of them or ``onnxscript`` (the exporter's) missing is a :class:`ToolError`."""
    import importlib

    found = []
    for name in ("onnx", "onnxscript", "onnxruntime"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            raise ToolError(f"format=onnx needs the Python module '{name}', which is not installed: "
                            "pip install 'sslkit[onnx]' (onnx, onnxscript and onnxruntime)") from None
    return found[0], found[2]


def _write_onnx(model: nn.Module, x: torch.Tensor, path: str, external_data: bool) -> str:
    """Write ``model`` traced on ``x`` to ``path`` (alone in its folder) with a dynamic batch axis, its weights in
    ``<path>.data`` if ``external_data``; returns the exporter used: torch.export's (``dynamo``, preferred) or, where
    that fails, the TorchScript one (``torchscript``)."""
    import warnings

    try:
        program = torch.onnx.export(model, (x,), None, input_names=[ONNX_INPUT], output_names=[ONNX_OUTPUT],
                                    dynamic_shapes=({0: torch.export.Dim("batch")},), dynamo=True, verbose=False)
        program.save(path, external_data=external_data)
        return "dynamo"
    except Exception as exc:  # any failure of torch.export: try the older exporter
        first = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    logger.warning("export: torch.onnx.export(dynamo=True) failed (%s); trying the TorchScript exporter", first)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its deprecation and tracer warnings: the check below decides
            torch.onnx.export(model, (x,), path, input_names=[ONNX_INPUT], output_names=[ONNX_OUTPUT],
                              dynamic_axes={ONNX_INPUT: {0: "batch"}, ONNX_OUTPUT: {0: "batch"}}, dynamo=False)
    except Exception as exc:
        raise ToolError(f"this trunk cannot be exported to ONNX: the dynamo exporter says {first}; the TorchScript "
                        f"exporter says {type(exc).__name__}: {exc}") from None
    if external_data:  # its own choice of files (one per tensor, if any): rewritten as the one <file>.data
        import onnx

        proto = onnx.load(path)
        folder, name = os.path.split(path)
        for other in os.listdir(folder):
            if other != name:
                os.remove(os.path.join(folder, other))
        onnx.save_model(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{name}.data")
    return "torchscript"


def _check_onnx(path: str, model: nn.Module, shape: tuple[int, int, int], dim: int) -> tuple[int, dict[str, float]]:
    """Run the graph at ``path`` with onnxruntime (CPU) on random inputs of the batch sizes it was not traced with and
    compare with ``model``'s features; returns ``(opset, {batch size: max abs difference})``. A fixed batch axis, a
    wrong name or shape, or a difference above the tolerance is a :class:`ToolError`: a bug."""
    import numpy as np

    onnx, ort = _onnx_modules()
    bug = "nothing was written; please report this as a bug"
    graph = onnx.load(path, load_external_data=False)
    opset = next((int(o.version) for o in graph.opset_import if o.domain in ("", "ai.onnx")), 0)
    first = graph.graph.input[0].type.tensor_type.shape.dim[0] if graph.graph.input else None
    try:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ToolError(f"onnxruntime cannot load the exported graph ({type(exc).__name__}: {exc}); {bug}") from None
    inputs, outputs = session.get_inputs(), session.get_outputs()
    names = ([i.name for i in inputs], [o.name for o in outputs])
    if names != ([ONNX_INPUT], [ONNX_OUTPUT]):
        raise ToolError(f"the exported graph's inputs and outputs are {names}, not {ONNX_INPUT!r} -> "
                        f"{ONNX_OUTPUT!r}; {bug}")
    batch = inputs[0].shape[0]
    if isinstance(batch, int) or first is None or first.HasField("dim_value") or not first.dim_param:
        raise ToolError(f"the exported graph's input {ONNX_INPUT!r} has the shape {inputs[0].shape}: its batch axis "
                        f"is fixed, not dynamic; {bug}")
    if list(inputs[0].shape[1:]) != list(shape):
        raise ToolError(f"the exported graph's input {ONNX_INPUT!r} has the shape {inputs[0].shape}, not "
                        f"[batch, {', '.join(map(str, shape))}]; {bug}")
    g = torch.Generator().manual_seed(0)
    measured: dict[str, float] = {}
    for n in _CHECKED_BATCHES:
        x = torch.randn(n, *shape, generator=g)
        with torch.no_grad():
            want = model(x).float().numpy()
        try:
            got = np.asarray(session.run([ONNX_OUTPUT], {ONNX_INPUT: x.numpy()})[0])
        except Exception as exc:
            raise ToolError(f"onnxruntime cannot run the exported graph on a {tuple(x.shape)} input "
                            f"({type(exc).__name__}: {exc}); {bug}") from None
        if got.shape != want.shape or got.shape != (n, dim):
            raise ToolError(f"on a {tuple(x.shape)} input the exported graph gives features of shape {got.shape}, "
                            f"PyTorch {want.shape}; {bug}")
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        worst = float(np.nanmax(diff)) if diff.size else 0.0
        if not np.all(diff <= ONNX_ATOL + ONNX_RTOL * np.abs(want)):  # NaN fails too
            worst = float("nan") if np.isnan(diff).any() else worst
            raise ToolError(f"the exported graph gives other features than the PyTorch trunk on a {tuple(x.shape)} "
                            f"input: max abs difference {worst:.3g} (allowed: {ONNX_ATOL:g} + {ONNX_RTOL:g} x "
                            f"|features|); {bug}")
        measured[str(n)] = worst
    return opset, measured


def export_onnx(trunk: nn.Module, path: str, channels: int, image_size: int) -> dict[str, Any]:
    """Write ``trunk`` (a float32 CPU copy in eval mode) as an ONNX graph to ``path``: input ``pixels``
    ``[batch, channels, image_size, image_size]``, output ``features`` ``[batch, D]``, the batch axis dynamic.

    It is exported next to ``path`` first and checked (:func:`_check_onnx`: onnxruntime against PyTorch on batch sizes
    other than the traced one), then moved into place with ``os.replace``; a failed check writes nothing. Returns the
    ``onnx`` entry of ``encoder.json``."""
    onnx, ort = _onnx_modules()
    model = copy.deepcopy(trunk).to("cpu", torch.float32).eval()
    shape = (int(channels), int(image_size), int(image_size))
    x = torch.randn(_TRACED_BATCH, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dim = int(model(x).shape[1])
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    external = size > _ONNX_SINGLE_FILE_BYTES
    folder = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    staging = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=folder)  # its own folder: the .data's name
    try:
        tmp = os.path.join(staging, name)
        exporter = _write_onnx(model, x, tmp, external)
        opset, measured = _check_onnx(tmp, model, shape, dim)
        data = tmp + ".data"
        external = os.path.exists(data)
        if external:
            os.replace(data, path + ".data")
        elif os.path.exists(path + ".data"):
            os.remove(path + ".data")  # an earlier export's weights, which this graph does not read
        os.replace(tmp, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    side = f"{image_size}x{image_size}"
    return {
        "opset": opset, "exporter": f"torch.onnx.export ({exporter})",
        "input": {"name": ONNX_INPUT, "shape": ["batch", *shape], "dtype": "float32"},
        "output": {"name": ONNX_OUTPUT, "shape": ["batch", dim], "dtype": "float32"},
        "dynamic_axes": f"batch (axis 0) only: the image size is fixed at {side} (resize and crop images to it)",
        "external_data": f"{name}.data" if external else None,
        "tolerance": {"atol": ONNX_ATOL, "rtol": ONNX_RTOL,
                      "rule": "|onnxruntime - torch| <= atol + rtol * |torch| on every feature"},
        "checked": {"provider": "CPUExecutionProvider", "traced_batch": _TRACED_BATCH, "inputs": "randn",
                    "max_abs_difference": measured},
        "onnxruntime": str(ort.__version__), "onnx": str(onnx.__version__), "torch": str(torch.__version__),
        "load": f"import onnxruntime; features = onnxruntime.InferenceSession('{name}', "
                f"providers=['CPUExecutionProvider']).run(['{ONNX_OUTPUT}'], {{'{ONNX_INPUT}': x}})[0]  # x: float32 "
                f"[batch, {channels}, {image_size}, {image_size}], pixels in [0, 1] normalised (x - mean) / std as "
                "'input' says",
    }


def _save(path: str, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    if path.endswith(".safetensors"):
        from safetensors.torch import save

        data = save(state, metadata={"sslkit": json.dumps(meta)})
        atomic_write(path, lambda f: f.write(data))
    else:
        atomic_write(path, lambda f: torch.save(state, f))


def _twin(mode: str, trunk: nn.Module, cfg: Any, channels: int) -> tuple[str, str | None]:
    """What ``twin=mode`` exports for: ``("torchvision", name)``, ``("timm", None)`` or ``("none", None)``; a twin
    the trunk does not have is a :class:`ToolError` saying what to give instead."""
    vit = timm_twin(trunk) is not None
    if mode == "auto":
        mode = "timm" if vit else "torchvision"
    if mode == "none":
        return mode, None
    if mode == "timm":
        if not vit:
            raise ToolError(f"twin=timm: model.trunk={cfg.model.trunk} is not a ViT, and only sslkit's ViTs are timm's "
                            "networks. Export it with twin=torchvision (ResNets) or twin=none (sslkit's own trunk).")
        return mode, None
    if vit:
        raise ToolError(f"twin=torchvision: model.trunk={cfg.model.trunk} is a ViT, timm's VisionTransformer, with no "
                        "torchvision twin. Export it with twin=timm (the default, twin=auto, does) or twin=none.")
    name, why = torchvision_twin(cfg, channels)
    if name is None:
        raise ToolError(f"this trunk has no torchvision twin: {why}. Export it with twin=none (a state_dict for "
                        "sslkit's own trunk builder, sslkit.models.trunks), or pretrain a torchvision trunk "
                        "(model.trunk=resnet50 without small_image_stem).")
    return mode, name


def _builder_kwargs(cfg: Any, channels: int) -> dict[str, Any]:
    """The arguments sslkit's trunk builder was called with (``model.trunk_kwargs`` completed with the channels and,
    for a ViT, the data's image and patch size), JSON-plain."""
    from sslkit import registry as R
    from sslkit.builder import trunk_arguments

    builder = R.get(R.TRUNKS, cfg.model.trunk, "model.trunk")
    return json.loads(json.dumps(trunk_arguments(cfg, builder, channels), default=str))


def _format(opts: dict[str, str]) -> str:
    """What ``format=`` and ``output=`` ask for: ``safetensors``, ``pt`` or ``onnx``; an unknown format, an output of
    another extension, or ``format=onnx`` with an explicit ``twin=`` is a :class:`ToolError` naming both."""
    output, given = opts.get("output"), opts.get("format")
    if given is not None and given not in FORMATS:
        raise ToolError(f"format={given}: use format={', format='.join(FORMATS)}.{did_you_mean(given, FORMATS)}")
    if given == "hf":  # a folder
        files = tuple(e for exts in FORMATS.values() for e in exts)
        if (output and output.lower().endswith(files)) or opts.get("twin", "auto") != "auto":
            raise ToolError("format=hf writes a folder (config.json, model.safetensors) for transformers' AutoModel: "
                            "give output=FOLDER and no twin=")
        return given
    by_extension = next((f for f, exts in FORMATS.items() if output and output.lower().endswith(exts)), None)
    if output and by_extension is None:
        wanted = " or ".join(FORMATS[given]) if given else ".safetensors, .pt or .onnx"
        raise ToolError(f"output={output}: the file's extension says the format: {wanted}")
    if given and by_extension and given != by_extension:
        raise ToolError(f"output={output} is a .{output.rpartition('.')[2]} file but format={given} writes "
                        f"{' or '.join(FORMATS[given])}: give one of them, or matching ones")
    fmt = given or by_extension or "safetensors"
    if fmt == "onnx" and opts.get("twin", "auto") != "auto":
        raise ToolError(f"twin={opts['twin']} does not apply to format=onnx: the ONNX graph is the architecture, it "
                        "loads into no torchvision or timm model. Leave twin= out, or export weights "
                        "(format=safetensors) for a twin.")
    return fmt


def _architecture(trunk: nn.Module, cfg: Any, channels: int) -> str:
    """What the trunk is, in words: ``timm <arch>``, ``torchvision.models.<name>`` or ``sslkit trunk <name>``."""
    vit = timm_twin(trunk)
    if vit is not None:
        return f"timm {vit[0]}"
    name, _ = torchvision_twin(cfg, channels)
    return f"torchvision.models.{name}" if name else f"sslkit trunk {cfg.model.trunk}"


def _weights(trunk: nn.Module, twin: tuple[str, str | None], fmt: str, file: str, trunk_name: str
             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The trunk's weights for its ``twin`` (``(kind, torchvision name)``: timm for a ViT, torchvision for a ResNet,
    none) and what the sidecar says of them: the architecture, the classifier, how to load ``file``."""
    kind, name = twin
    loader = "safetensors.torch.load_file" if fmt == "safetensors" else "torch.load"
    if kind == "timm":
        state, arch, kwargs, left_out = export_vit(trunk)
        pooled = "the CLS token" if kwargs.get("global_pool") == "token" else "the mean patch token"
        return state, {
            "architecture": f"timm {arch}", "timm_arch": arch, "timm_kwargs": kwargs,
            "classifier": f"none (num_classes=0): the model's output is the pooled features ({pooled})",
            "left_out": left_out or None, "format": fmt,
            "load": f"m = timm.create_model('{arch}', num_classes=0, **encoder_json['timm_kwargs']); "
                    f"m.load_state_dict({loader}('{file}'))"}
    state = export_trunk(trunk, name)
    return state, {
        "architecture": f"torchvision.models.{name}" if name else f"sslkit trunk {trunk_name}",
        "classifier": "fc = torch.nn.Identity()" if name else None, "format": fmt,
        "load": (f"m = torchvision.models.{name}(); m.fc = torch.nn.Identity(); "
                 f"m.load_state_dict({loader}('{file}'))") if name else
                (f"import sslkit.models; m = sslkit.registry.TRUNKS.get('{trunk_name}')"
                 f"(**encoder_json['builder_kwargs']); m.load_state_dict({loader}('{file}'))")}


def _export(args: list[str]) -> int:
    from sslkit.tools.common import features_part, parse_tool_args, part_module, tool_pretrained

    opts, overrides = parse_tool_args("export", args, EXPORT_KEYS)
    output = opts.get("output")
    twin_mode = opts.get("twin", "auto")
    if twin_mode not in TWIN_MODES:
        raise ToolError(f"twin={twin_mode}: use twin={', twin='.join(TWIN_MODES)}")
    fmt = _format(opts)
    if fmt == "onnx":
        _onnx_modules()  # said before the checkpoint is read
    pre: Pretrained = tool_pretrained("export", opts, overrides)
    part = features_part(opts, ("trunk", "teacher"))
    trunk = part_module(pre, part)
    channels = int(next(p for p in trunk.parameters() if p.ndim == 4).shape[1])
    path = output or os.path.join(pre.run_dir, "export", "hf" if fmt == "hf" else f"encoder{FORMATS[fmt][0]}")
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    file = os.path.basename(path)
    norm = normalisation(pre.config, channels)
    meta: dict[str, Any]
    state: dict[str, torch.Tensor] = {}
    if fmt == "hf":
        from sslkit.tools.export_hf import export_hf

        entry = export_hf(trunk, path)
        meta = {"architecture": f"transformers {entry['class']}", "format": "hf", "hf": entry, "load": entry["load"]}
    elif fmt == "onnx":
        vit = timm_twin(trunk)
        image_size = int(vit[1]["img_size"]) if vit is not None else int(norm["image_size"])
        entry = export_onnx(trunk, path, channels, image_size)
        meta = {"architecture": _architecture(trunk, pre.config, channels), "format": "onnx", "onnx": entry,
                "load": entry["load"]}
        if vit is not None:
            meta.update({"timm_arch": vit[0], "timm_kwargs": vit[1]})
    else:
        state, meta = _weights(trunk, _twin(twin_mode, trunk, pre.config, channels), fmt, file,
                               str(pre.config.model.trunk))
    meta.update({"trunk_kwargs": dict(pre.config.model.trunk_kwargs),
                 "builder_kwargs": _builder_kwargs(pre.config, channels), "in_channels": channels,
                 "feature_dim": int(getattr(trunk, "out_dim", 0)) or None, "input": norm,
                 "method": str(pre.config.method.name), "features": part, "checkpoint": pre.path, "step": pre.step})
    if fmt not in ("onnx", "hf"):
        _save(path, state, meta)
    sidecar = os.path.splitext(path)[0] + ".json"
    text = json.dumps(meta, indent=1)
    atomic_write(sidecar, lambda f: f.write(text.encode()))
    if fmt == "hf":
        logger.info("export: the %s (step %d) as a transformers %s folder -> %s; transformers reads it whole and "
                    "matches sslkit's tokens (max abs difference %.2g, allowed %g); input: pixels in [0, 1], mean %s, "
                    "std %s; details in %s", part, pre.step, meta["hf"]["class"], path,
                    meta["hf"]["checked"]["max_abs_difference"], 1e-5, norm["mean"], norm["std"], sidecar)
    elif fmt == "onnx":
        checked = meta["onnx"]["checked"]["max_abs_difference"]
        logger.info("export: the %s (step %d) as an ONNX graph -> %s (%s, opset %d); input %r %s, pixels in [0, 1], "
                    "mean %s, std %s; onnxruntime matches PyTorch (max abs difference %s, allowed %g + %g x "
                    "|features|); details in %s", part, pre.step, path, meta["architecture"], meta["onnx"]["opset"],
                    ONNX_INPUT, meta["onnx"]["input"]["shape"], norm["mean"], norm["std"],
                    ", ".join(f"{v:.2g} at batch {k}" for k, v in checked.items()), ONNX_ATOL, ONNX_RTOL, sidecar)
    else:
        logger.info("export: %d tensors of the %s (step %d) -> %s (%s); input: pixels in [0, 1], mean %s, std %s; "
                    "details in %s", len(state), part, pre.step, path, meta["architecture"], norm["mean"],
                    norm["std"], sidecar)
    return 0


def export_main(argv: list[str] | None = None) -> int:
    """``sslkit export checkpoint=RUN_DIR [output=encoder.safetensors] [format=safetensors|pt|onnx]
    [features=teacher] [twin=auto|torchvision|timm|none]``"""
    from sslkit.tools.common import run_tool

    keys = "\n".join(f"  {k}=...  {v}" for k, v in EXPORT_KEYS.items())
    usage = ("usage: sslkit export checkpoint=RUN_DIR|FILE [output=encoder.safetensors] [format=onnx] "
             "[key=value ...]\n\n"
             "The trunk's weights as a plain state_dict that loads with strict=True into the matching torchvision "
             "model (a ResNet, fc = nn.Identity()) or timm model (a ViT, num_classes=0), or with format=onnx the trunk "
             "as an ONNX graph (input 'pixels' [batch, C, H, W], output 'features' [batch, D], the batch axis dynamic, "
             "checked with onnxruntime before it is written); and its input normalisation and the model's arguments "
             "in a .json next to it.\n\n" + keys)
    return run_tool("export", _export, argv, usage)
