"""Which partition of the optimizer's work an optimizer needs, and which rank owns each parameter in the
parameter partition.

[Note: optimizer partitions]
Stages 1-3 split the optimizer's state over the ranks in one of two ways (``ZeroConfig.optimizer_partition``):
  * **elements** (the ZeRO paper's, section 5.1): every rank steps its flat 1/N region of every parameter
    (stages 1-2: a 1-D view of the parameter; stage 3: the shard).  Exact only when the update of an
    element reads that element alone (its gradient, its state, scalars shared by the whole tensor such as
    the step count), so that stepping pieces and stepping the whole give the same numbers.
  * **parameters** (``ZeroRedundancyOptimizer``'s scheme): each parameter is owned whole by one rank
    (:func:`assign_owners`); its owner assembles the full reduced gradient and the full master from the
    ranks' regions, steps it in its real shape, and sends each rank its region of the result back
    (``optim/whole_params.py``).  Exact for every optimizer that treats parameters independently: one whose
    update reads the whole tensor (Adafactor's factored row/column moments and its parameter RMS, Muon's
    Newton-Schulz orthogonalisation, LAMB/LARS trust ratios, the 8-bit block-wise quantization of
    bitsandbytes and its ``min_8bit_size``).  Per rank and step it adds, in the masters' dtype, about
    2·Ψ·(N-1)/N² elements sent to the owners (gradient and master regions) and Ψ·(N-1)/N² back; optimizer
    state stays sharded (each rank holds the state of the parameters it owns, ~1/N of the model when
    parameters are many and balanced), plus, during the step only, the owner's whole master and gradient of
    the parameters it owns.
``"auto"`` (the default) picks elements for the optimizers in :data:`ELEMENTWISE`, each checked against
torch's source, and parameters for every other, unknown ones included: a slower step is better than a
silently wrong one.  A subclass is not trusted (it may override ``step``): it gets parameters unless forced.
Forcing elements on an optimizer in :data:`SHAPE_AWARE` (or a subclass) is refused.  Stage 0 keeps whole
parameters on every rank and ignores the setting.  An optimizer that needs *all* parameters in one process
(LBFGS: one flat vector and a closure) fits neither and is refused at setup.

Why each class is elementwise (torch 2.13's ``torch/optim``; every update below reads, per element, the
gradient, the parameter and state tensors of the parameter's shape, plus scalars shared by the tensor):
  SGD (momentum, dampening, nesterov, weight decay), Adam and AdamW (amsgrad's running max is elementwise;
  fused and foreach kernels compute the same per element), Adagrad (``lr_decay`` reads the step count),
  RMSprop (``centered`` keeps an elementwise mean), NAdam (``mu_product`` is a scalar of the step), RAdam
  (the rectification term is a scalar of the step), Adamax (elementwise running max of ``|g|``), ASGD
  (``eta``/``mu`` are scalars of the step; ``ax`` averages elementwise), Rprop (per-element step sizes from the
  sign of ``g·g_prev``), Adadelta (elementwise running averages).  Lion (``lion_pytorch.Lion``, the sign of an
  elementwise interpolation) where it is installed.
Not elementwise: ``torch.optim.Adafactor`` (factored second moments of 2-D and larger tensors) and
transformers' ``Adafactor`` (the same, plus ``scale_parameter``'s RMS of the parameter), ``torch.optim.Muon``
(orthogonalises the 2-D update), ``SparseAdam`` (sparse gradients, which the reducers never produce), every
bitsandbytes optimizer (block-wise 8-bit state laid out over the flattened tensor; ``min_8bit_size`` by the
tensor's numel).
"""

from __future__ import annotations

import torch

from ..tensors.flat import ShardLayout

__all__ = ["ELEMENTWISE", "SHAPE_AWARE", "assign_owners", "choose_partition"]

# Qualified class names ("module.Class") whose update is elementwise (see the Note above).
ELEMENTWISE = frozenset(
    f"torch.optim.{module}.{name}"
    for module, name in (
        ("sgd", "SGD"),
        ("adam", "Adam"),
        ("adamw", "AdamW"),
        ("adagrad", "Adagrad"),
        ("rmsprop", "RMSprop"),
        ("nadam", "NAdam"),
        ("radam", "RAdam"),
        ("adamax", "Adamax"),
        ("asgd", "ASGD"),
        ("rprop", "Rprop"),
        ("adadelta", "Adadelta"),
    )
) | {"lion_pytorch.lion_pytorch.Lion"}

# Known to read a parameter's shape or a whole-tensor statistic: "elements" is refused for these.
SHAPE_AWARE = frozenset(
    {
        "torch.optim.Adafactor",
        "torch.optim.Muon",
        "torch.optim.sparse_adam.SparseAdam",
        "transformers.optimization.Adafactor",
    }
)
_SHAPE_AWARE_PACKAGES = ("bitsandbytes.",)
# Needs every parameter in one process: no partition serves it.
_WHOLE_MODEL = frozenset({"torch.optim.lbfgs.LBFGS"})


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _shape_aware(cls: type) -> bool:
    for base in cls.__mro__:
        name = _qualname(base)
        if name in SHAPE_AWARE or name.startswith(_SHAPE_AWARE_PACKAGES):
            return True
    return False


def choose_partition(optimizer: torch.optim.Optimizer, requested: str, stage: int) -> str:
    """``"elements"`` or ``"parameters"`` for ``optimizer`` at ``stage`` ([Note: optimizer partitions]);
    ``ValueError`` naming the optimizer and the fix where the request cannot be exact."""
    cls = type(optimizer)
    name = _qualname(cls)
    if any(_qualname(base) in _WHOLE_MODEL for base in cls.__mro__) and stage > 0:
        raise ValueError(
            f"zp.setup: {name} steps every parameter as one flat vector with a closure, which needs the whole "
            f"model in one process; at ZeRO stage {stage} each rank holds part of the optimizer's work. Use stage 0 "
            "(plain data parallelism) with it, or an optimizer that steps parameters independently"
        )
    if stage == 0:
        return "elements"  # whole parameters on every rank: every optimizer is exact
    if requested == "elements" and _shape_aware(cls):
        raise ValueError(
            f"ZeroConfig.optimizer_partition='elements' with {name}: its update reads each parameter's shape or a "
            "statistic of the whole tensor, so stepping 1/N flat regions would train to different weights. Use "
            "optimizer_partition='auto' (or 'parameters'): each parameter is then stepped whole by one rank"
        )
    if requested != "auto":
        return requested
    return "elements" if name in ELEMENTWISE else "parameters"


def assign_owners(numels: list[int], world_size: int) -> list[int]:
    """The rank that owns each parameter: largest first to the least loaded rank (ties: lowest rank), among
    the ranks whose flat region of it is not empty (``ShardLayout``: a parameter of few elements lives on the
    first ranks only), so every owner holds part of what it owns.  Deterministic: every rank computes the same."""
    owners = [0] * len(numels)
    load = [0] * world_size  # elements owned so far, by rank
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        numel = numels[i]
        holders = -(-numel // ShardLayout(numel, world_size, 0).shard_numel) if numel else 1
        rank = min(range(holders), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numel
    return owners
