"""MoCo v2 (Chen et al., 2020) and MoCo v3 (Chen, Xie & He, 2021): momentum-encoder keys and InfoNCE.

MoCo v2 (model ``moco``, loss ``moco``): the query encoder is trunk + MLP head; the key encoder is
a frozen copy moved by the ``momentum_teacher`` hook (constant momentum 0.999). The loss contrasts
each query with its key against a queue of earlier keys, a buffer of the loss.

Shuffle-BN. With BatchNorm, a query and its positive key computed in the same batch can "cheat":
the batch statistics carry information between the samples of a batch, so the model can lower
the loss by finding the sub-batch a key came from rather than by learning good features (MoCo,
He et al. 2020, section 3.3). MoCo's fix, done here in the key encoder's forward
(:func:`shuffled_forward`):

* several processes: the key inputs are gathered from every rank (``gather_no_grad``),
  permuted by a permutation every rank derives identically (``torch.randperm`` with a generator
  seeded from the model's step counter, so no broadcast is needed), each rank encodes its slice
  of the shuffled batch, the keys are gathered back and un-shuffled. A key's BN statistics then
  come from a random sub-batch, not from the rank that computed its query.
* one process: the batch is permuted and encoded in ``shuffle_groups`` chunks (default 2), each
  with its own BN statistics, then un-permuted -- the single-GPU emulation of the above (the
  split BatchNorm of the official MoCo CIFAR-10 notebook does the same for both encoders). The
  query encoder normalises over the whole query batch, each key over a random part of the key
  batch, so a key's statistics are not those its query was normalised with.

The step counter is a plain int saved as the model's extra state (``_extra_state`` in its
state dict), so a resumed run draws the same permutations and nothing syncs the device.
SyncBatchNorm over the global batch (``distributed.sync_bn``) is the other cure (SimCLR's global
BN; MoCo v3 uses SyncBN): no sub-batch is then special. Shuffling is MoCo v2's own choice and
keeps BN local and cheap; with ``sync_bn`` on, the statistics are global anyway and the shuffle
changes nothing but costs an extra gather.

MoCo v3 (model ``mocov3``, loss ``mocov3``): query encoder trunk + projector + predictor, momentum
encoder trunk + projector (cosine momentum 0.99 -> 1), symmetric InfoNCE against the keys of the
other view of the whole (gathered) batch; no queue, and no shuffle (the paper uses SyncBN; on one
process plain BN is what it sees).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sslkit.clock import StepContext
from sslkit.distributed import gather_no_grad, get_rank, is_distributed
from sslkit.methods.base import Method, register_method
from sslkit.methods.infonce import cross_entropy_at
from sslkit.models.heads import MLPHead
from sslkit.models.output import ModelOutput
from sslkit.models.ssl_model import SSLModel, check_two_views, forward_views
from sslkit.models.teacher import PredictorTeacherModel, frozen_copy, projection_dim
from sslkit.registry import register_loss, register_model

__all__ = [
    "MOCO",
    "MOCOV3",
    "MoCoLoss",
    "MoCoModel",
    "MoCoV3Loss",
    "build_moco",
    "build_mocov3",
    "moco_infonce",
    "moco_logits",
    "mocov3_infonce",
    "mocov3_logits",
    "shuffled_forward",
]


# ------------------------------------------------------------------------------- shuffle-BN
@torch.no_grad()
def shuffled_forward(encoder: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     num_groups: int, seed: int) -> torch.Tensor:
    """``encoder(x)`` with BatchNorm statistics taken over random sub-batches (MoCo's shuffle-BN).

    With a process group, ``x`` [B, ...] is gathered from every rank, permuted with
    ``torch.randperm(world * B)`` seeded with ``seed`` (the same on every rank), this rank
    encodes rows ``[rank * B, (rank + 1) * B)`` of the permuted batch, and the outputs are
    gathered and un-permuted; ``num_groups`` is then unused (each rank's slice is one group).
    With one process, the permuted batch is encoded in ``num_groups`` chunks (``1``: a plain
    forward). Row ``i`` of the result is always the encoding of ``x[i]``. No gradient.
    """
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed)
    if is_distributed():
        b = x.shape[0]
        x_all = gather_no_grad(x)
        perm = torch.randperm(x_all.shape[0], generator=gen, device=x.device)
        lo = get_rank() * b
        out_shuffled = gather_no_grad(encoder(x_all[perm[lo : lo + b]]))
        out = torch.empty_like(out_shuffled)
        out[perm] = out_shuffled
        return out[lo : lo + b]
    if num_groups <= 1:
        return encoder(x)
    if x.shape[0] < 2 * num_groups:
        raise ValueError(f"shuffle-BN needs at least 2 samples per group: batch {x.shape[0]}, "
                         f"shuffle_groups {num_groups}")
    perm = torch.randperm(x.shape[0], generator=gen, device=x.device)
    out_shuffled = torch.cat([encoder(chunk) for chunk in x[perm].chunk(num_groups)])
    out = torch.empty_like(out_shuffled)
    out[perm] = out_shuffled
    return out


# ---------------------------------------------------------------------------------- MoCo v2
class MoCoModel(SSLModel):
    """MoCo v2: query encoder ``head(trunk(.))``, key encoder a frozen copy of it run with shuffle-BN.

    ``forward([v0, v1])`` returns::

        features    = [trunk(v0)]              # + trunk(v1) when symmetric
        projections = [q0]                     # queries (+ q1 when symmetric)
        targets     = [k(v1)]                  # the keys: targets[i] is the positive of projections[i]:
                                               # [k(v1), k(v0)] when symmetric; no grad

    Non-symmetric (the paper) only ``v0`` goes through the query encoder, so its BatchNorm sees
    the query batch alone and no compute is spent on an unused query. The keys come from
    :func:`shuffled_forward` with ``shuffle_groups`` chunks on one process.
    """

    def __init__(self, trunk: nn.Module, head: nn.Module | None = None, symmetric: bool = False,
                 shuffle_groups: int = 2) -> None:
        if shuffle_groups < 1:
            raise ValueError(f"shuffle_groups must be >= 1, got {shuffle_groups}")
        super().__init__(trunk, head)
        self.teacher_trunk = frozen_copy(self.trunk)
        self.teacher_head = frozen_copy(self.head)
        self.symmetric = symmetric
        self.shuffle_groups = shuffle_groups
        #: Key forwards done so far: the seed of the next shuffle (checkpointed as extra state).
        self.shuffle_step = 0

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(student, teacher) pairs for the ``momentum_teacher`` hook: trunk and head."""
        return [(self.trunk, self.teacher_trunk), (self.head, self.teacher_head)]

    def _key_encoder(self, x: torch.Tensor) -> torch.Tensor:
        return self.teacher_head(self.teacher_trunk(x))

    @torch.no_grad()
    def encode_keys(self, x: torch.Tensor) -> torch.Tensor:
        """Key-encoder projections of ``x`` with shuffle-BN; advances the shuffle counter."""
        out = shuffled_forward(self._key_encoder, x, self.shuffle_groups, self.shuffle_step)
        self.shuffle_step += 1
        return out

    def forward(self, views: Sequence[torch.Tensor] | torch.Tensor) -> ModelOutput:
        """Queries (with grad) and their positive keys (without)."""
        v0, v1 = check_two_views(views, "moco")
        q_views, k_views = ([v0, v1], [v1, v0]) if self.symmetric else ([v0], [v1])
        feats = forward_views(self.trunk, q_views)
        q = self.head(torch.cat(feats) if len(feats) > 1 else feats[0])
        k = self.encode_keys(torch.cat(k_views) if len(k_views) > 1 else k_views[0])
        return ModelOutput(features=feats, projections=list(q.chunk(len(q_views))), targets=list(k.chunk(len(k_views))))

    def get_extra_state(self) -> dict[str, int]:
        """The shuffle counter, saved in the state dict."""
        return {"shuffle_step": self.shuffle_step}

    def set_extra_state(self, state: dict[str, int]) -> None:
        """Restore :meth:`get_extra_state`."""
        self.shuffle_step = int(state["shuffle_step"])


@register_model("moco")
def build_moco(trunk: nn.Module, head: nn.Module | None = None, symmetric: bool = False,
               shuffle_groups: int = 2) -> MoCoModel:
    """MoCo v2: query encoder trunk + MLP head, momentum key encoder with shuffle-BN.

    Paper (ImageNet, ResNet-50): head ``Linear(2048) - ReLU - Linear(128)`` without BN
    (``model.head: {hidden_dim: 2048, out_dim: 128, batch_norm: false}``); not symmetric.
    ``symmetric`` also contrasts ``v1``'s query with ``v0``'s key (the symmetrised MoCo v2 of
    the SimSiam and MoCo v3 papers), at twice the query-encoder cost.
    """
    return MoCoModel(trunk, head, symmetric=symmetric, shuffle_groups=shuffle_groups)


def moco_logits(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[q.k+, q.queue] / T`` [B, 1 + K]: the positive logit in column 0, then one per queued key.

    ``q`` and ``k`` are L2-normalised here; ``queue`` [K, d] is assumed normalised already.
    """
    q = F.normalize(q.float(), dim=1)
    k = F.normalize(k.detach().float(), dim=1)
    pos = (q * k).sum(dim=1, keepdim=True)
    neg = q @ queue.detach().float().T
    return torch.cat([pos, neg], dim=1) / temperature


def moco_infonce(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, temperature: float = 0.2) -> torch.Tensor:
    """MoCo's InfoNCE (He et al. 2020, eq. 1), averaged over the batch::

        L_q = -log( exp(q.k+ / T) / (exp(q.k+ / T) + sum_{i=1..K} exp(q.k_i / T)) )

    with ``q`` the query, ``k+`` its key (stop-gradient), ``k_i`` the queued keys of earlier
    batches and every vector L2-normalised. The cross entropy of :func:`moco_logits` with label 0.
    """
    logits = moco_logits(q, k, queue, temperature)
    return cross_entropy_at(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))


@register_loss("moco")
class MoCoLoss(nn.Module):
    """MoCo's InfoNCE against a FIFO queue of keys; the queue and its pointer are buffers.

    Config: ``loss: {name: moco, temperature, queue_size, dim}``. ``dim`` must be the head's
    output size (recipes set ``dim: ${model.head.out_dim}``). The queue starts as random unit
    vectors drawn from a fixed generator (identical on every rank).

    ``forward`` averages :func:`moco_infonce` over the pairs ``(projections[i], targets[i])``, then
    -- only when grad is enabled (train steps) -- enqueues the batch's keys gathered from every
    rank (``gather_no_grad``), oldest first out, wrapping around at ``queue_size``; so every rank
    holds the same queue. Logs ``acc``: how often the positive has the largest logit.

    ``temperature`` 0.2 and ``queue_size`` 65536 are the ImageNet values (1.28M images);
    :meth:`enqueue` works for any batch size, divisible or not.
    """

    queue: torch.Tensor
    queue_ptr: torch.Tensor

    def __init__(self, temperature: float = 0.2, queue_size: int = 65536, dim: int = 128) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"moco temperature must be > 0, got {temperature}")
        if queue_size < 1 or dim < 1:
            raise ValueError(f"moco queue_size and dim must be >= 1, got {queue_size} and {dim}")
        self.temperature = temperature
        gen = torch.Generator().manual_seed(0)
        self.register_buffer("queue", F.normalize(torch.randn(queue_size, dim, generator=gen), dim=1))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        """Write ``keys`` [n, dim] (L2-normalised here) at the pointer, wrapping at the queue size.

        Key ``j`` goes to row ``(ptr + j) % K``; when ``n > K`` only the last ``K`` keys stay
        (the earlier ones would be overwritten in the same call). The pointer moves to
        ``(ptr + n) % K``. On the device, without a host sync.
        """
        n, size = keys.shape[0], self.queue.shape[0]
        keys = F.normalize(keys.detach().float(), dim=1).to(self.queue.dtype)
        first = max(0, n - size)
        idx = (self.queue_ptr + torch.arange(first, n, device=self.queue.device)) % size
        self.queue.index_copy_(0, idx, keys[first:])
        self.queue_ptr.copy_((self.queue_ptr + n) % size)

    def forward(self, output: dict[str, Any], sample: dict[str, Any],
                ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """Mean InfoNCE over query/key pairs against the current queue; then enqueue (train only)."""
        queries, keys = output["projections"], output["targets"]
        if len(queries) != len(keys) or not queries:
            raise ValueError(f"moco needs one key per query, got {len(queries)} queries and {len(keys)} keys")
        if keys[0].shape[1] != self.queue.shape[1]:
            raise ValueError(f"moco keys have {keys[0].shape[1]} dimensions but the queue {self.queue.shape[1]}: "
                             "set loss.dim to the head's out_dim (${model.head.out_dim})")
        queue = self.queue.clone()  # the enqueue below writes in place; backward needs this copy
        losses, accs = [], []
        for q, k in zip(queries, keys):
            logits = moco_logits(q, k, queue, self.temperature)
            target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
            losses.append(cross_entropy_at(logits, target))
            accs.append((logits.detach().argmax(dim=1) == 0).float().mean())
        if torch.is_grad_enabled():
            self.enqueue(gather_no_grad(torch.cat(list(keys))))
        return {"loss": torch.stack(losses).mean(), "acc": torch.stack(accs).mean()}


# ---------------------------------------------------------------------------------- MoCo v3
@register_model("mocov3")
def build_mocov3(
    trunk: nn.Module,
    head: nn.Module | None = None,
    predictor_hidden_dim: int = 4096,
    predictor_num_layers: int = 2,
    predictor_last_bn: bool = False,
) -> PredictorTeacherModel:
    """MoCo v3: query encoder trunk + projector (``head``) + predictor; momentum encoder = frozen copy
    of trunk + projector. Outputs ``targets`` (the keys): ``targets[i]`` is the momentum encoder's projection of
    the view other than ``predictions[i]``'s (see :class:`~sslkit.methods.byol.PredictorTeacherModel`).

    Official ResNet-50 code: projector ``Linear(4096) - BN - ReLU - Linear(256) - BN(affine=False)``
    (``model.head: {num_layers: 2, hidden_dim: 4096, out_dim: 256, last_bn: true}``; 3 layers
    for ViT), predictor ``Linear(256, 4096) - BN - ReLU - Linear(4096, 256)`` without a last BN
    (``predictor_last_bn: false``; the paper's text and first code release put BN after every
    layer of both MLPs, which ``predictor_last_bn: true`` gives). The predictor's output size is
    the projector's, since it is compared with the momentum encoder's projection.
    """
    dim = projection_dim(trunk, head)
    predictor = MLPHead(dim, predictor_hidden_dim, dim, num_layers=predictor_num_layers,
                        last_bn=predictor_last_bn)
    return PredictorTeacherModel(trunk, head, predictor)


def mocov3_logits(q: torch.Tensor, k: torch.Tensor, temperature: float,
                  gather: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q @ k_all.T / T, labels)`` of :func:`mocov3_infonce`: [B, world * B] logits, own-key labels."""
    b = q.shape[0]
    q = F.normalize(q.float(), dim=1)
    k = F.normalize(k.detach().float(), dim=1)
    k_all = gather_no_grad(k) if gather else k
    offset = get_rank() * b if k_all.shape[0] != b else 0
    labels = torch.arange(b, device=q.device) + offset
    return q @ k_all.T / temperature, labels


def mocov3_infonce(q: torch.Tensor, k: torch.Tensor, temperature: float = 0.2,
                   gather: bool = True) -> torch.Tensor:
    """MoCo v3's contrastive loss of one direction (Chen, Xie & He 2021, Algorithm 1, ``ctr``)::

        logits = q @ k_all.T / T          # q, k L2-normalised; k_all: the keys of every rank
        loss   = CE(logits, labels) * 2T  # labels = arange(B) + rank * B: the own key

    ``k`` is detached and, with ``gather`` and a process group, gathered from every rank
    (``gather_no_grad``); the other keys of the global batch are the negatives. The ``2T``
    factor makes the gradient scale insensitive to ``T``.
    """
    logits, labels = mocov3_logits(q, k, temperature, gather)
    return cross_entropy_at(logits, labels) * (2 * temperature)


@register_loss("mocov3")
class MoCoV3Loss(nn.Module):
    """MoCo v3's symmetrised loss ``ctr(q1, k2) + ctr(q2, k1)`` (Algorithm 1): the **sum** over the
    pairs ``(predictions[i], targets[i])`` of :func:`mocov3_infonce`. Logs ``acc`` (own key ranked first).

    ``temperature`` 0.2 is the paper's value for ViT (``--moco-t=.2``); the official ResNet-50
    recipe keeps the code default 1.0. 0.2 suits the small batches of CPU runs.
    """

    def __init__(self, temperature: float = 0.2, gather: bool = True) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"mocov3 temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.gather = gather

    def forward(self, output: dict[str, Any], sample: dict[str, Any],
                ctx: StepContext | None = None) -> dict[str, torch.Tensor]:
        """Sum of both directions; ``acc`` the mean top-1 of the own key over the global batch."""
        preds, keys = output["predictions"], output["targets"]
        if len(preds) != len(keys) or not preds:
            raise ValueError(f"mocov3 needs one key per prediction, got {len(preds)} and {len(keys)}")
        losses, accs = [], []
        for p, k in zip(preds, keys):
            logits, labels = mocov3_logits(p, k, self.temperature, self.gather)
            losses.append(cross_entropy_at(logits, labels) * (2 * self.temperature))
            accs.append((logits.detach().argmax(dim=1) == labels).float().mean())
        return {"loss": torch.stack(losses).sum(), "acc": torch.stack(accs).mean()}


#: The method object: what ``method.name=moco`` trains.
MOCO = register_method(Method(
    name="moco", model="moco", loss="moco", required_hooks=("momentum_teacher",), transform="simclr",
    summary="MoCo v2 (Chen et al., 2020): InfoNCE against a queue of keys from a momentum encoder with shuffle-BN.",
))


#: The method object: what ``method.name=mocov3`` trains.
MOCOV3 = register_method(Method(
    name="mocov3", model="mocov3", loss="mocov3", required_hooks=("momentum_teacher",), transform="simclr",
    summary=("MoCo v3 (Chen, Xie & He, 2021): a predictor on the query encoder, symmetric InfoNCE against"
             " momentum keys."),
))
