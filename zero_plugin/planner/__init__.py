"""Memory planner: per-rank device and host bytes of a training step for each ZeRO stage.

    import zero_plugin.planner as zpp
    zpp.estimate("llama-7b", world_size=8, stage=3, param_dtype="bf16", batch=1, seq=2048)
    plan = zpp.Planner("llama-7b", param_dtype="bf16", batch=1, seq=2048)   # one trace, many rows
    plan.fit(world_size=8, gpu_mem=24 * 2**30, host_mem=128 * 2**30)

``plan.py``: ``Planner`` (what each part of an estimate counts), the settings and their cost;
``trace.py``: the model and one forward + backward on fake tensors as a timeline; ``replay.py``: that
timeline replayed as the engine allocates, with the engine's own schedule constants; ``comm_time.py``:
bytes per step on each link and an alpha-beta estimate of the communication time (``comm_rows``).
"""

from .comm_time import DEFAULT_INTER, DEFAULT_INTRA, OPTIONS, Link, Option, Phase, Topology, comm_rows, step_phases
from .plan import COST_MODEL, SETTINGS, Planner, cost, estimate
from .trace import BUILTIN_MODELS, SYNTHETIC_BLOCKS, resolve_model

__all__ = [
    "DEFAULT_INTER",
    "DEFAULT_INTRA",
    "OPTIONS",
    "Link",
    "Option",
    "Phase",
    "Topology",
    "comm_rows",
    "step_phases",
    "BUILTIN_MODELS",
    "COST_MODEL",
    "SETTINGS",
    "SYNTHETIC_BLOCKS",
    "Planner",
    "cost",
    "estimate",
    "resolve_model",
]
