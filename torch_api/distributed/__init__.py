"""``torch_api.distributed``: the solves with the clouds sharded over a ``torch.distributed``
process group (NCCL on GPUs, Gloo on CPUs), launched with ``torchrun``.

Every rank holds a shard of each cloud (rows in rank order); every rank gathers the clouds once,
streams its own rows against the full other cloud, and exchanges only O(n + m) numbers per
half-step (:mod:`ot_triton_jax.core.sharding`). :mod:`.solve` holds the OTT-convention
``sinkhorn`` and ``sinkhorn_divergence``, :mod:`.ops` their loops and autograd Functions;
:mod:`.loss` GeomLoss's ``SamplesLoss`` / ``samples_loss`` (one all-gather per softmin, none in
the backward), :mod:`.loss_ops` its sharded softmin and gradient rows; :mod:`.hvp` the
Hessian-vector product (the core CG on replicated vectors, every plan pass sharded by rows).
"""

from .hvp import hvp
from .loss import SamplesLoss, samples_loss
from .solve import DistributedDivergenceOutput, DistributedSinkhornOutput, sinkhorn, sinkhorn_divergence

__all__ = ["sinkhorn", "sinkhorn_divergence", "SamplesLoss", "samples_loss", "hvp", "DistributedSinkhornOutput",
           "DistributedDivergenceOutput"]
