"""zero_plugin: ZeRO-1/2/3 sharded data parallelism and CPU offload on torch.distributed."""

from .api import clip_grad_norm_, gathered_parameters, no_sync, rebind_optimizer, setup
from .checkpoint import load_checkpoint, save_checkpoint
from .colocate import offload_states, reload_states
from .comm.stats import comm_stats, reset_comm_stats
from .config import ZeroConfig
from .config_groups import CommConfig, DebugConfig, LoadingConfig, OffloadConfig, PrecisionConfig, Stage3Config
from .loading import materialize as materialize  # zp.materialize.* as documented (docs/large-models.md)
from .memory import memory_report
from .optim.zero_optimizer import ZeroOptimizer
from .sequence import SequenceParallelLoader, sequence_parallel_batch, sequence_parallel_loss, sequence_parallel_of
from .sequence.tiled_loss import tiled_lm_loss
from .state_dict import full_state_dict, load_full_state_dict

__version__ = "0.1.0"

__all__ = [
    "ZeroConfig",
    "OffloadConfig",
    "PrecisionConfig",
    "CommConfig",
    "Stage3Config",
    "LoadingConfig",
    "DebugConfig",
    "ZeroOptimizer",
    "setup",
    "rebind_optimizer",
    "clip_grad_norm_",
    "no_sync",
    "gathered_parameters",
    "full_state_dict",
    "load_full_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "memory_report",
    "offload_states",
    "reload_states",
    "comm_stats",
    "reset_comm_stats",
    "sequence_parallel_batch",
    "sequence_parallel_loss",
    "sequence_parallel_of",
    "SequenceParallelLoader",
    "tiled_lm_loss",
]
