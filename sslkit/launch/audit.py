"""Find on the CPU what would break or stall a train step on CUDA: device-less tensors, host syncs, nondeterminism.

A step that is correct on the CPU can still fail on a GPU: a tensor made without ``device=``
lives on the CPU and meets CUDA tensors in the next ``torch.cat`` ("Expected all tensors to be on
the same device"), and an ``.item()``, a ``print(tensor)``, a boolean-mask index or an indexed
assignment of a Python number (``x[idx] = 0.0``, which copies the number to the GPU) makes the
host wait for the GPU in the middle of the step. On the CPU neither shows, so CI never sees them.

:class:`StepAudit` is a ``TorchFunctionMode`` that watches every torch call made directly by the
code under its roots (sslkit's own package and the modules a config imports) and records those
two kinds of call with the file and line. It also watches every operation the step runs (torch's
own too, backward included) for those that PyTorch documents as raising on CUDA under
``torch.use_deterministic_algorithms(True)``, which ``machine.deterministic=true`` turns on.
:func:`audit_recipe` runs a few real train steps of a recipe under it; ``python tools/audit.py
config=NAME [key=value ...]`` prints what it finds.
Calls made inside torch itself, by the data loader workers, and by hooks outside the step
(logging and checkpointing at their intervals, where syncing is their job) are not watched.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Finding", "StepAudit", "audit_recipe"]

_SSLKIT = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
#: torch files that only forward a call (dispatch plumbing): the caller is the frame above them.
_PLUMBING = tuple(os.path.join(_TORCH, f) for f in ("overrides.py", "_tensor.py", "utils/_device.py"))

_T = torch.Tensor
#: Calls that copy a device tensor to the host and so wait for every kernel queued before them.
_SYNCS: dict[Any, str] = {
    _T.item: "reads the value on the host", _T.tolist: "reads the values on the host",
    _T.__bool__: "branches on a tensor's value", _T.__int__: "reads the value on the host",
    _T.__float__: "reads the value on the host", _T.__index__: "reads the value on the host",
    _T.cpu: "copies to the host", _T.numpy: "copies to the host",
    _T.__repr__: "formats a tensor", _T.__str__: "formats a tensor", _T.__format__: "formats a tensor",
    torch.nonzero: "has an output size only the host learns", _T.nonzero: "has an output size only the host learns",
    torch.argwhere: "has an output size only the host learns",
    torch.masked_select: "has an output size only the host learns",
    _T.masked_select: "has an output size only the host learns",
    torch.unique: "has an output size only the host learns", _T.unique: "has an output size only the host learns",
    torch.unique_consecutive: "has an output size only the host learns",
    torch.equal: "returns a Python bool", _T.equal: "returns a Python bool",
    torch.allclose: "returns a Python bool", _T.allclose: "returns a Python bool",
    _T.is_nonzero: "returns a Python bool",
}


#: Operations (aten, backward included) that raise on CUDA under torch.use_deterministic_algorithms(True),
#: from PyTorch's documentation of that function, with the usual way around them.
_NONDETERMINISTIC: dict[str, str] = {
    "aten._adaptive_avg_pool2d_backward": "AdaptiveAvgPool2d's CUDA backward (output larger than 1x1): use avg_pool2d "
                                          "or sslkit.models.trunks.grid_pool",
    "aten._adaptive_avg_pool3d_backward": "AdaptiveAvgPool3d's CUDA backward",
    "aten.adaptive_max_pool2d_backward": "AdaptiveMaxPool2d's CUDA backward",
    "aten.avg_pool3d_backward": "AvgPool3d's CUDA backward",
    "aten.fractional_max_pool2d_backward": "FractionalMaxPool2d's CUDA backward",
    "aten.fractional_max_pool3d_backward": "FractionalMaxPool3d's CUDA backward",
    "aten.max_unpool2d": "MaxUnpool", "aten.max_unpool3d": "MaxUnpool",
    "aten.upsample_linear1d_backward": "interpolate(linear)'s CUDA backward",
    "aten.upsample_bilinear2d_backward": "interpolate(bilinear)'s CUDA backward",
    "aten.upsample_bicubic2d_backward": "interpolate(bicubic)'s CUDA backward",
    "aten.upsample_trilinear3d_backward": "interpolate(trilinear)'s CUDA backward",
    "aten.reflection_pad1d_backward": "ReflectionPad's CUDA backward",
    "aten.reflection_pad2d_backward": "ReflectionPad's CUDA backward",
    "aten.reflection_pad3d_backward": "ReflectionPad's CUDA backward",
    "aten.nll_loss_forward": "NLLLoss / F.cross_entropy on CUDA: use sslkit.methods.infonce.cross_entropy_at",
    "aten.nll_loss2d_forward": "NLLLoss on CUDA",
    "aten._ctc_loss_backward": "CTCLoss's CUDA backward",
    "aten.put_": "Tensor.put_", "aten.histc": "torch.histc on CUDA",
    "aten.grid_sampler_2d_backward": "grid_sample's CUDA backward",
    "aten.grid_sampler_3d_backward": "grid_sample's CUDA backward",
    "aten.scatter_reduce": "scatter_reduce on CUDA", "aten.scatter_reduce_": "scatter_reduce on CUDA",
}


@dataclass(frozen=True)
class Finding:
    """One call that would misbehave on CUDA: what kind, which call, where, and what to do instead."""

    #: ``no-device`` (a tensor made on the default device, the CPU), ``host-sync``, or ``nondeterministic``
    #: (raises on CUDA under ``machine.deterministic=true``).
    kind: str
    #: The torch call, e.g. ``torch.zeros`` or ``Tensor.item``.
    call: str
    #: ``path:line in function`` of the code that made the call.
    where: str
    #: Why it matters and the usual fix.
    hint: str

    def __str__(self) -> str:
        return f"{self.where}: {self.call} [{self.kind}] {self.hint}"


def _name(func: Any) -> str:
    owner = "Tensor" if getattr(func, "__qualname__", "").startswith(("Tensor.", "TensorBase.")) else "torch"
    return f"{owner}.{getattr(func, '__name__', repr(func))}"


def _has_tensor(index: Any, *, boolean: bool) -> bool:
    """Whether an index (or a tuple of them) holds a tensor of bool dtype (``boolean``) or of another dtype."""
    parts = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(p, torch.Tensor) and (p.dtype == torch.bool) == boolean for p in parts)


class StepAudit(TorchFunctionMode):
    """Records the torch calls, made directly by code under ``roots``, that misbehave on CUDA.

    Use as a context manager around the code to audit; :attr:`findings` lists each distinct
    (kind, call, place) once, in the order first seen. ``roots`` are folders (default: sslkit's
    package); a call counts when the frame that made it (past torch's dispatch plumbing) lies in
    one of them. What is recorded:

    * ``no-device``: a factory (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ``torch.full``,
      ...) called without ``device=``: on CUDA its result is a CPU tensor. Use ``device=`` of a
      neighbour, or ``x.new_zeros`` / ``torch.zeros_like``. An explicit ``device="cpu"`` is not
      recorded: it says the CPU is meant.
    * ``host-sync``: ``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ``.cpu()``, printing
      a tensor, ``nonzero`` / ``masked_select`` / ``unique`` / one-argument ``torch.where``,
      ``torch.equal``, indexing with a boolean mask (``x[mask]``), and assigning a Python
      number through an integer index tensor (``x[rows, cols] = -inf``: use ``masked_fill`` or
      ``index_fill_``).
    * ``nondeterministic``: any operation of the step (torch's own and backward ones included)
      that PyTorch raises on under ``torch.use_deterministic_algorithms(True)`` on CUDA, placed at
      the nearest frame under ``roots``.
    """

    def __init__(self, roots: Sequence[str] = (_SSLKIT,)) -> None:
        super().__init__()
        self.roots = tuple(os.path.abspath(r) + os.sep for r in roots)
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, str, str]] = set()
        self._ops = _OpWatch(self)

    def __enter__(self) -> StepAudit:
        super().__enter__()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ops.__exit__(*exc)
        super().__exit__(*exc)

    def _nearest(self) -> str:
        """``path:line in function`` of the innermost frame under ``roots`` (or the innermost one)."""
        frame: FrameType | None = sys._getframe(2)
        first = frame
        while frame is not None and not os.path.abspath(frame.f_code.co_filename).startswith(self.roots):
            frame = frame.f_back
        frame = frame or first
        if frame is None:
            return "?"
        return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"

    def _add(self, kind: str, call: str, where: str, hint: str) -> None:
        key = (kind, call, where)
        if key not in self._seen:
            self._seen.add(key)
            self.findings.append(Finding(kind, call, where, hint))

    def _caller(self) -> FrameType | None:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(_PLUMBING)
                                     or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        return frame

    def _record(self, kind: str, func: Any, hint: str) -> None:
        frame = self._caller()
        if frame is None:
            return
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(self.roots):
            return
        self._add(kind, _name(func), f"{os.path.relpath(path)}:{frame.f_lineno} in {frame.f_code.co_name}", hint)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None \
                and not (args and isinstance(args[0], torch.Tensor)):
            self._record("no-device", func, "makes a CPU tensor on CUDA runs: pass device= (of a neighbouring "
                                            "tensor) or use x.new_*() / *_like()")
        elif func in _SYNCS:
            self._record("host-sync", func, f"{_SYNCS[func]}: the host waits for the GPU; keep it to the log "
                                            "interval or keep the value on the device")
        elif func is torch.where and len(args) + len(kwargs) == 1:
            self._record("host-sync", func, "one-argument torch.where is nonzero(): its size only the host learns")
        elif func is _T.__getitem__ and len(args) > 1 and _has_tensor(args[1], boolean=True):
            self._record("host-sync", func, "indexing with a boolean mask has a size only the host learns: use "
                                            "torch.where(mask, x, 0) or a weighted sum")
        elif func is _T.__setitem__ and len(args) > 2:
            index, value = args[1], args[2]
            if isinstance(value, int | float | bool) and _has_tensor(index, boolean=False):
                self._record("host-sync", func, "assigning a Python number through an index tensor copies it to "
                                                "the GPU and waits: use masked_fill / index_fill_ / scatter_")
            elif isinstance(value, torch.Tensor) and _has_tensor(index, boolean=True):
                self._record("host-sync", func, "assigning through a boolean mask needs nonzero(): use "
                                                "torch.where(mask, value, x)")
        return func(*args, **kwargs)


class _OpWatch(TorchDispatchMode):
    """The dispatch-level half of :class:`StepAudit`: every aten operation, backward ones included."""

    def __init__(self, audit: StepAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = str(func.overloadpacket)
        if name in _NONDETERMINISTIC:
            self.audit._add("nondeterministic", name, self.audit._nearest(),
                            f"{_NONDETERMINISTIC[name]}: raises on CUDA under machine.deterministic=true")
        return func(*args, **(kwargs or {}))


def _module_dir(name: str) -> str:
    module = importlib.import_module(name)
    path = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)
    if path is None:
        raise ValueError(f"cannot tell where module {name!r} lives")
    return os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else os.path.abspath(path)


def audit_recipe(overrides: Sequence[str], steps: int = 3) -> list[Finding]:
    """Train ``steps`` steps of the recipe ``overrides`` (``config=NAME key=value ...``) on the CPU,
    each step under a :class:`StepAudit` whose roots are sslkit and the modules in ``imports``.

    The Gram loss starts at the first step unless ``gram.start_step`` is given (a recipe's start lies past the
    audit's steps). The run writes only to a temporary folder; kNN, TensorBoard and periodic checkpoints are off,
    the log interval lies past the last step, and the data is read by one loader worker (data
    workers are separate processes, outside the audit). Returns the findings.
    """
    from sslkit.builder import build_task
    from sslkit.config.compose import compose_config
    from sslkit.registry import TRAIN_STEPS, get
    from sslkit.trainer import train

    # a stage that starts after the audit's last step (config=dinov3's Gram loss at step 156) would stop the config
    # check and stay unaudited: here it starts at the first step, unless the command sets it
    starts = [] if any(o.startswith("gram.start_step=") for o in overrides) else ["gram.start_step=0"]
    with tempfile.TemporaryDirectory(prefix="sslkit_audit_") as out:
        cfg = compose_config([*starts, *overrides, "machine.device=cpu", f"optim.max_steps={steps}",
                              "eval.knn.enabled=false",
                              "log.tensorboard=false", "log.progress_bar=false", f"log.every_n_steps={steps + 1}",
                              "checkpoint.every_n_epochs=0", "checkpoint.every_n_steps=0", "data.num_workers=1",
                              f"output_dir={out}"])
        audit = StepAudit([_SSLKIT, *(_module_dir(m) for m in cfg.imports)])
        step = get(TRAIN_STEPS, cfg.train_step, "train_step")

        def audited(task: Any) -> None:
            with audit:
                step(task)

        train(build_task(cfg), audited)
    return audit.findings
