"""A plain torch.distributed script (no launcher of ours, no Lightning): zp.setup at a stage (``plain``: none),
two steps, then ``dist.destroy_process_group()`` as ``examples/full_finetune.py`` ends, with the model and the
optimizer still referenced, and return.  Prints the process's thread count before the process group, right
after ``destroy_process_group()`` and at exit, after every other exit handler ([Note: cached groups at exit]
in ``zero_plugin/comm/groups.py``).  The optimizer is made after ``init_process_group``, as scripts do: that
is when torch first imports ``torch.distributed.nn``, unless zero_plugin was imported before."""

from __future__ import annotations

import atexit
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero_plugin as zp  # noqa: E402
from tests import models  # noqa: E402


def _threads() -> int:
    """Every thread of the process, gloo's C++ threads included (``threading`` sees Python's only)."""
    return len(os.listdir("/proc/self/task"))


def main() -> None:
    stage = sys.argv[1]
    counts = {"before": _threads()}
    atexit.register(
        lambda: print("THREADS " + " ".join(f"{k}={v}" for k, v in counts.items()), f"at_exit={_threads()}")
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    model = models.make_odd_mlp(dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stage != "plain":
        model, optimizer = zp.setup(model, optimizer, zp.ZeroConfig(stage=int(stage)))
    for batch in models.make_batches("mlp", 2, dist.get_world_size(), 2, seed=0, dtype=torch.float32):
        models.loss_fn(model, models.shard_batch(batch, dist.get_rank(), dist.get_world_size())).backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    dist.destroy_process_group()
    counts["after_destroy"] = _threads()


if __name__ == "__main__":
    main()
