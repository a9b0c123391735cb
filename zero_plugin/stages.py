"""The stage table: which components make up each ZeRO stage.

=====  ============  =========================================  =====================
stage  masters       reducer (backward)                         after step
=====  ============  =========================================  =====================
0      whole param   all-reduce, full grads kept (DDP)          -
1      own region    reduce-scatter, full grads kept            all-gather params
2      own region    reduce-scatter, only the shard kept        all-gather params
3      own shard     see ``stage3/``                            - (gathered per unit)
=====  ============  =========================================  =====================

Evaluation only (``zp.setup(model, None, config)``): stage 3 shards the parameters with a forward-only
runtime and nothing else ([Note: evaluation-only models] in ``stage3/inference.py``); stages 0-2 keep
the model replicated, as DDP does with a model it does not train, and build no engine (``api.py`` does not
ask for one).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .comm.collectives import Comm
from .config import ZeroConfig
from .engines.engine import Engine, EngineBasis
from .engines.param_sync import ParamAllGather
from .engines.replicated import ReplicatedEngine, cast_frozen, make_masters
from .grads.reducer import AllReduceReducer, ReduceScatterReducer

__all__ = ["REPLICATED_STAGES", "ReplicatedStage", "build_engine", "build_inference_engine"]


@dataclass(frozen=True, slots=True)
class ReplicatedStage:
    """How a stage 0-2 engine is composed; the planner's replay (``planner/replay.py``) reads the same rows."""

    sharded_masters: bool
    """Masters of this rank's region only, gradients reduce-scattered to their owners, and the parameters
    all-gathered after the step (``ParamAllGather``); False: whole masters, gradients all-reduced (DDP)."""
    keep_full_grad: bool
    """The full gradients stay in ``param.grad`` after their reduction (stages 0-1); False: they go as soon
    as they are reduced and only the owned region is kept (ZeRO-2)."""


REPLICATED_STAGES = {
    0: ReplicatedStage(sharded_masters=False, keep_full_grad=True),
    1: ReplicatedStage(sharded_masters=True, keep_full_grad=True),
    2: ReplicatedStage(sharded_masters=True, keep_full_grad=False),
}


def build_engine(
    model: nn.Module, trainable: list[tuple[str, nn.Parameter]], config: ZeroConfig, comm: Comm, param_source=None
) -> Engine:
    if config.stage == 3:
        from .stage3.engine import build_stage3_engine

        return build_stage3_engine(model, trainable, config, comm, param_source)
    spec = REPLICATED_STAGES[config.stage]
    cast_frozen(model, trainable, config)
    slots = make_masters(trainable, comm, config, sharded=spec.sharded_masters)
    bucket_bytes = int(config.comm.bucket_size_mb * 2**20)
    common = dict(comm=comm, reduce_dtype=config.effective_reduce_dtype, bucket_bytes=bucket_bytes)
    if spec.sharded_masters:
        reducer = ReduceScatterReducer(slots, keep_full_grad=spec.keep_full_grad, **common)
        param_sync = ParamAllGather(slots, comm, bucket_bytes)
    else:
        reducer = AllReduceReducer(slots, **common)
        param_sync = None
    return ReplicatedEngine(EngineBasis(model, config, comm, slots), reducer, param_sync)


def build_inference_engine(model: nn.Module, config: ZeroConfig, comm: Comm, param_source=None) -> Engine:
    """Stage 3: the parameters sharded for evaluation only (stages 0-2 keep the model replicated and build no
    engine: ``api._setup_for_evaluation`` never calls this for them)."""
    assert config.stage == 3, "evaluation-only engines exist at stage 3 only"
    from .stage3.engine import build_stage3_engine
    from .stage3.inference import InferenceEngine

    return build_stage3_engine(model, [], config, comm, param_source, engine_type=InferenceEngine)
