"""SwAV (Caron et al., 2020): online clustering with Sinkhorn-Knopp codes and swapped prediction over multi-crop."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.clock import StepContext
from sslkit.hooks.freeze import FreezeParametersHook
from sslkit.methods.base import Method, register_method
from sslkit.methods.sinkhorn import sinkhorn_knopp
from sslkit.models.output import ModelOutput
from sslkit.models.ssl_model import SSLModel, forward_views
from sslkit.registry import register_hook, register_loss, register_model

if TYPE_CHECKING:
    from sslkit.task import SSLTask

__all__ = ["SWAV", "SwAVLoss", "SwAVModel", "SwAVPrototypesHook", "build_swav", "swapped_prediction_loss"]

logger = logging.getLogger("sslkit")


# --------------------------------------------------------------------------------------- model
class SwAVModel(SSLModel):
    """Trunk + projector + prototypes ``C`` (a bias-free linear layer, rows = prototype vectors).

    ``forward(views)`` runs the trunk once per crop resolution (:func:`forward_views`: the 2
    global crops together, the N small crops together), the projector and the prototypes once
    over every crop, and returns, one tensor per view:

    * ``features``: trunk features (what kNN and linear probes read, from ``model.trunk``);
    * ``projections``: the L2-normalised embeddings ``z = g(f(x)) / |g(f(x))|``;
    * ``scores``: prototype scores ``z C^T`` (cosine similarities once the prototypes are unit
      rows, which the ``swav_prototypes`` hook keeps them);

    and ``prototypes``: the prototype matrix ``C`` [K, d], detached, so that the loss can score
    its queue of past embeddings with the current prototypes (data flows forward).
    """

    def __init__(self, trunk: nn.Module, head: nn.Module | None = None, num_prototypes: int = 100,
                 embedding_dim: int | None = None) -> None:
        super().__init__(trunk, head)
        if num_prototypes < 1:
            raise ValueError(f"swav needs num_prototypes >= 1, got {num_prototypes}")
        dim = embedding_dim or getattr(head, "out_dim", None) or getattr(trunk, "out_dim", None)
        if dim is None:
            raise ValueError("swav cannot tell the embedding size: give model.kwargs.embedding_dim")
        self.prototypes = nn.Linear(int(dim), num_prototypes, bias=False)
        with torch.no_grad():
            self.prototypes.weight.copy_(F.normalize(self.prototypes.weight, dim=1))

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor) -> ModelOutput:
        """Features, normalised projections and prototype scores per view, and the prototypes."""
        if isinstance(views, torch.Tensor):
            views = [views]
        feats = forward_views(self.trunk, views)
        sizes = [f.shape[0] for f in feats]
        z = F.normalize(self.head(torch.cat(feats) if len(feats) > 1 else feats[0]), dim=1)
        scores = self.prototypes(z)
        return ModelOutput(features=feats, projections=list(z.split(sizes)), scores=list(scores.split(sizes)),
                           prototypes=self.prototypes.weight.detach())


@register_model("swav")
def build_swav(trunk: nn.Module, head: nn.Module | None = None, num_prototypes: int = 100,
               embedding_dim: int | None = None) -> SwAVModel:
    """SwAV wiring: trunk, projector (``model.head``; paper: 2048 hidden, 128 out) and
    ``num_prototypes`` prototypes (paper: 3000 for ImageNet). ``embedding_dim`` defaults to the
    head's ``out_dim``."""
    return SwAVModel(trunk, head, num_prototypes=num_prototypes, embedding_dim=embedding_dim)




# ----------------------------------------------------------------------------------------- loss
def swapped_prediction_loss(
    scores: Sequence[torch.Tensor],
    codes: Sequence[torch.Tensor],
    crops_for_assign: Sequence[int] = (0, 1),
    temperature: float = 0.1,
) -> torch.Tensor:
    """SwAV's swapped prediction loss (Caron et al. 2020, eqs. 1-2, with multi-crop).

    For each assignment crop ``i`` (with codes ``q_i`` [B, K], ``codes[j]`` for
    ``i = crops_for_assign[j]``) and every other crop ``v != i`` among the V crops::

        l(v, i) = -1/B sum_b sum_k q_i[b, k] log softmax(s_v[b] / T)_k
        L = 1/|assign| sum_i 1/(V - 1) sum_{v != i} l(v, i)

    ``scores[v]`` [B, K] are the prototype scores ``z_v C^T`` of crop v. The codes are targets
    (no gradient flows into them).
    """
    if len(codes) != len(crops_for_assign):
        raise ValueError(f"{len(codes)} code tensors for {len(crops_for_assign)} assignment crops")
    n_views = len(scores)
    if n_views < 2:
        raise ValueError(f"swav needs at least two crops per sample, got {n_views}")
    log_p = [F.log_softmax(s.float() / temperature, dim=1) for s in scores]
    total = scores[0].new_zeros((), dtype=torch.float32)
    for i, q in zip(crops_for_assign, codes):
        sub = sum(-(q.detach() * log_p[v]).sum(dim=1).mean() for v in range(n_views) if v != i)
        total = total + sub / (n_views - 1)
    return total / len(crops_for_assign)


@register_loss("swav")
class SwAVLoss(nn.Module):
    """SwAV loss: Sinkhorn codes of the assignment crops, predicted from every other crop.

    Config: ``loss: {name: swav, temperature, epsilon, sinkhorn_iterations, crops_for_assign,
    queue_length, queue_start_step, embedding_dim}``.

    Reads ``output["scores"]``, ``output["projections"]`` and ``output["prototypes"]`` (from the
    ``swav`` model). For each assignment crop i, ``q_i = sinkhorn_knopp(scores_i)`` (in float64); with a queue, the
    scores of the queued embeddings of crop i (``queue_i C^T``, with the current prototypes) are
    stacked above the batch's before Sinkhorn, and only the batch's rows of the codes are kept
    (the queue enlarges the set the prototypes are equipartitioned over, for small batches).

    State (checkpointed with ``loss.state_dict()``):

    * buffer ``queue`` [len(crops_for_assign), queue_length, embedding_dim] of past normalised
      embeddings of the assignment crops, newest first (``queue_length`` is per process, as in
      the reference code's ``queue_length // world_size``);
    * extra state ``queue_filled`` (valid queue rows) and the collapse check's open window.

    The queue starts filling at optimizer update ``queue_start_step`` of the training clock
    (``ctx.clock.step``: with gradient accumulation, the same update as a run with the whole
    batch) and is used once full (the reference starts it at epoch 15 of 800 with batch 256).
    Every train micro-batch then pushes its embeddings. State advances only on train forwards:
    the loss module in training mode with gradients enabled (the stages' train phases); eval
    phases run under ``no_grad`` and leave it untouched. Called without a context, the loss is
    at update 0.

    Collapse check: every ``collapse_check_every`` train forwards (one host-device sync then,
    none in between), the mean loss over that window is compared with ``ln K``. With identical
    embeddings the codes are uniform and the loss is ``>= ln K``; at initialisation it is near
    ``ln K`` too, so windows ending in the first ``collapse_check_every`` updates are not judged.
    Later, a mean within ``collapse_tolerance * ln K`` of ``ln K`` (or above) logs a warning: at
    most one per window.
    """

    #: The queue holds this process's own past embeddings: checkpoints keep every rank's copy.
    rank_local_state: tuple[str, ...] = ("queue",)

    def __init__(
        self,
        temperature: float = 0.1,
        epsilon: float = 0.05,
        sinkhorn_iterations: int = 3,
        crops_for_assign: Sequence[int] = (0, 1),
        queue_length: int = 0,
        queue_start_step: int = 0,
        embedding_dim: int = 128,
        collapse_check_every: int = 200,
        collapse_tolerance: float = 0.02,
    ) -> None:
        super().__init__()
        if temperature <= 0 or epsilon <= 0:
            raise ValueError(f"swav temperature and epsilon must be > 0, got {temperature}, {epsilon}")
        if sinkhorn_iterations < 1:
            raise ValueError(f"swav sinkhorn_iterations must be >= 1, got {sinkhorn_iterations}")
        if not crops_for_assign:
            raise ValueError("swav crops_for_assign must name at least one crop")
        if queue_length < 0 or queue_start_step < 0:
            raise ValueError(f"swav queue_length and queue_start_step must be >= 0, got {queue_length}, "
                             f"{queue_start_step}")
        self.temperature = float(temperature)
        self.epsilon = float(epsilon)
        self.sinkhorn_iterations = int(sinkhorn_iterations)
        self.crops_for_assign = [int(c) for c in crops_for_assign]
        self.queue_length = int(queue_length)
        self.queue_start_step = int(queue_start_step)
        self.embedding_dim = int(embedding_dim)
        self.collapse_check_every = int(collapse_check_every)
        self.collapse_tolerance = float(collapse_tolerance)
        self.register_buffer("queue", torch.zeros(len(self.crops_for_assign), self.queue_length, self.embedding_dim))
        self.register_buffer("_window_sum", torch.zeros(()), persistent=False)
        self.queue_filled = 0
        self._window_count = 0

    # the python counters travel in state_dict() under "_extra_state" (checkpointed, no sync)
    def get_extra_state(self) -> dict[str, int | float]:
        """``queue_filled`` and the collapse check's open window (its loss sum: one host sync, at checkpoint
        time only), saved with the module's state dict, so a resumed run judges the same windows as an
        uninterrupted one."""
        return {"queue_filled": self.queue_filled, "window_count": self._window_count,
                "window_sum": float(self._window_sum.item())}

    def set_extra_state(self, state: dict[str, int | float]) -> None:
        """Restore :meth:`get_extra_state`."""
        self.queue_filled = int(state["queue_filled"])
        self._window_count = int(state["window_count"])
        self._window_sum.fill_(float(state["window_sum"]))

    @property
    def queue_active(self) -> bool:
        """True once the queue is full: its entries then join the Sinkhorn batch."""
        return self.queue_length > 0 and self.queue_filled >= self.queue_length

    def codes(self, output: dict[str, Any]) -> list[torch.Tensor]:
        """The Sinkhorn codes ``q_i`` [B, K] of each assignment crop (with the queue when active)."""
        scores = output["scores"]
        codes = []
        with torch.no_grad():
            for j, i in enumerate(self.crops_for_assign):
                s = scores[i].detach().float()
                b = s.shape[0]
                if self.queue_active:
                    protos = output["prototypes"].detach().float()
                    s = torch.cat([self.queue[j] @ protos.T, s])
                codes.append(sinkhorn_knopp(s, self.epsilon, self.sinkhorn_iterations, dtype=torch.float64)[-b:])
        return codes

    def forward(self, output: dict[str, Any], sample: dict[str, Any], ctx: StepContext | None = None) -> torch.Tensor:
        """The swapped prediction loss of this batch; on train forwards, advance the queue."""
        scores = output["scores"]
        if max(self.crops_for_assign) >= len(scores):
            raise ValueError(f"swav crops_for_assign={self.crops_for_assign} but the model gave "
                             f"{len(scores)} crops")
        loss = swapped_prediction_loss(scores, self.codes(output), self.crops_for_assign, self.temperature)
        if self.training and torch.is_grad_enabled():
            self._advance(output, loss, scores[0].shape[1], ctx.clock.step if ctx is not None else 0)
        return loss

    @torch.no_grad()
    def _advance(self, output: dict[str, Any], loss: torch.Tensor, num_prototypes: int, update: int) -> None:
        length = self.queue_length
        if length > 0 and update >= self.queue_start_step:  # update: the 0-based optimizer update of this forward
            proj = output["projections"]
            if proj[0].shape[1] != self.embedding_dim:
                raise ValueError(f"swav loss embedding_dim={self.embedding_dim} but the projections have "
                                 f"{proj[0].shape[1]} dimensions: set loss.embedding_dim")
            n = min(proj[0].shape[0], length)
            for j, i in enumerate(self.crops_for_assign):
                if n < length:  # shift the older entries back, drop the oldest
                    self.queue[j, n:] = self.queue[j, : length - n].clone()
                self.queue[j, :n] = proj[i][:n].detach().float()
            self.queue_filled = min(length, self.queue_filled + n)
        if self.collapse_check_every > 0:
            self._window_sum += loss.detach().float()
            self._window_count += 1
            if self._window_count >= self.collapse_check_every:
                self._check_collapse(num_prototypes, update)

    def _check_collapse(self, num_prototypes: int, update: int) -> None:
        mean = float(self._window_sum.item()) / self._window_count  # the one sync, once per window
        self._window_sum.zero_()
        self._window_count = 0
        if update < self.collapse_check_every:
            return  # the start of training, where the loss is near ln(K) anyway
        ln_k = math.log(num_prototypes)
        if num_prototypes > 1 and mean >= (1.0 - self.collapse_tolerance) * ln_k:
            logger.warning(
                "swav: the loss has stayed at %.4f, near ln(K)=%.4f (K=%d prototypes), for %d steps up to "
                "train step %d: the codes are uniform, the embeddings may have collapsed. Try a smaller "
                "epsilon, more prototypes, freeze_prototypes_steps, or a lower learning rate.",
                mean, ln_k, num_prototypes, self.collapse_check_every, update + 1,
            )


# ---------------------------------------------------------------------------------------- hook
@register_hook("swav_prototypes")
class SwAVPrototypesHook(FreezeParametersHook):
    """Keeps SwAV's prototypes on the unit sphere and frozen at the start of training.

    * ``on_start`` and ``on_update``: L2-normalise the rows of the prototype weight (the
      reference normalises before every forward; after every update is the same thing).
    * ``on_backward``: while ``task.clock.step < freeze_prototypes_steps`` (optimizer updates),
      drop the prototypes' gradient (``grad = None``, as the reference code does), so the optimizer skips them:
      no step, no momentum, no weight decay (paper: 313 iterations, the first ImageNet epoch at
      batch 4096). That is :class:`~sslkit.hooks.freeze.FreezeParametersHook`'s freeze (the one mechanism).

    ``module`` is the attribute path of the prototype layer in ``task.base_model``.
    """

    name = "swav_prototypes"
    hint = "use model.name=swav, or set the hook's module"

    def __init__(self, freeze_prototypes_steps: int = 313, module: str = "prototypes") -> None:
        if freeze_prototypes_steps < 0:
            raise ValueError(f"freeze_prototypes_steps must be >= 0, got {freeze_prototypes_steps}")
        super().__init__([([f"{module}.*"], "steps", int(freeze_prototypes_steps))])
        self.freeze_prototypes_steps = int(freeze_prototypes_steps)
        self.module = module

    def _layer(self, task: SSLTask) -> nn.Module:
        try:
            return task.base_model.get_submodule(self.module)
        except AttributeError as exc:
            raise AttributeError(f"swav_prototypes: the model has no submodule '{self.module}' "
                                 "(use model.name=swav, or set the hook's module)") from exc

    @torch.no_grad()
    def _normalize(self, task: SSLTask) -> None:
        w = self._layer(task).weight
        w.copy_(F.normalize(w, dim=1))

    def on_start(self, task: SSLTask) -> None:
        """Normalise the prototypes once before a fresh run. Not after a resume: the checkpointed
        prototypes were normalised by the last ``on_update``, and normalising again is not exact in
        floating point (the last bits move), so a resumed run would drift from an uninterrupted one."""
        if task.clock.step == 0:
            self._normalize(task)

    def on_update(self, task: SSLTask) -> None:
        """Project the prototypes back onto the unit sphere after the optimizer step."""
        self._normalize(task)


#: The method object: what ``method.name=swav`` trains.
SWAV = register_method(Method(
    name="swav", model="swav", loss="swav", required_hooks=("swav_prototypes",), transform="multicrop",
    summary="SwAV (Caron et al., 2020): swapped prediction of Sinkhorn cluster codes over multi-crop views.",
))
