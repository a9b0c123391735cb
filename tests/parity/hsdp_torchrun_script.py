"""Run by ``test_parity_hsdp.py::test_torchrun_two_nodes`` under two torchrun launchers (2 nodes x 2 processes):
stage 3 with ``shard_group_size="node"`` (LOCAL_WORLD_SIZE=2 from torchrun), trained on the global batches
``hsdp_workers`` uses; each rank writes its losses, clip norms and full parameters to ``<out>/rank-<r>.pt``."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zero_plugin as zp  # noqa: E402
from tests import models  # noqa: E402
from tests.parity import hsdp_workers, workers  # noqa: E402


def main(out: str, steps: int, accum: int, max_norm: float) -> None:
    dist.init_process_group("gloo")
    batches = models.make_batches("mlp", steps * accum, world_size=1, per_rank_batch=12, seed=0)
    model = workers.build_model("mlp")
    model, opt = zp.setup(model, workers.build_optimizer(model), zp.ZeroConfig(stage=3, shard_group_size="node"))
    losses, norms = [], []
    for step in range(steps):
        loss, norm = hsdp_workers._step(model, opt, batches[step * accum : (step + 1) * accum], max_norm)
        losses.append(loss)
        norms.append(norm)
    shard_world = model._zero_plugin_engine.comm.world_size
    full = zp.full_state_dict(model, rank0_only=False)
    torch.save(
        {"losses": losses, "clip_norms": norms, "full": full, "shard_world": shard_world},
        os.path.join(out, f"rank-{dist.get_rank()}.pt"),
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
