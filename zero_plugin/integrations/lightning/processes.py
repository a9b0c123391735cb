"""What both ZeRO strategies share beyond ``lightning/common.py``: their own constructor options, ranks, the
process group, the collectives Lightning asks a strategy for (as Lightning's DDP strategies provide them), the
loaders under sequence parallelism and the sharded checkpoint write.

A mixin under both strategies' method mixins, over either package's ``ParallelStrategy``, reaching Lightning only
through ``self._fabric_names`` ([Note: one strategy source, two Lightning packages] in ``lightning/names.py``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn

import zero_plugin as zp

from . import common
from .exit import release_groups_at_exit
from .names import LightningNames

__all__ = ["ZeroProcesses"]


class ZeroProcesses:
    """Ranks and the process group of a strategy whose class statement sets ``_fabric_names``."""

    _fabric_names: LightningNames
    _resets_seed = False  # the Trainer strategy: as DDPStrategy, back to seed_everything's seed at setup

    def _set_options(
        self,
        config: Any,
        checkpoint: str,
        param_source: Any,
        meta_init: bool,
        process_group_backend: str | None,
        timeout: timedelta | None,
        sequence_parallel_size: int | None = None,
    ) -> None:
        """The constructor arguments both strategies take beyond Lightning's own (see ``ZeroStrategy``)."""
        self.config = common.resolve_config(config)
        if sequence_parallel_size is not None:
            self.config = self.config.replace(sequence_parallel_size=sequence_parallel_size)
        self.param_source = param_source
        self.meta_init = bool(meta_init)
        self._checkpoint = common.check_checkpoint_mode(checkpoint)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._hinted = False  # common.LOAD_HINT logged

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Over the data-parallel groups: the K ranks of a sequence-parallel group read the same batches."""
        world = self.num_nodes * self.num_processes
        k = self.config.resolved_sequence_parallel_size(world)
        return {"num_replicas": world // k, "rank": self.global_rank // k}

    def process_dataloader(self, dataloader: Any) -> Any:
        """With ``sequence_parallel_size`` > 1, each batch split for this rank (on its device: the split compares
        the group's batches with a collective) for the strategy's set-up module."""
        if self.config.comm.sequence_parallel_size == 1:
            return dataloader
        return zp.SequenceParallelLoader(dataloader, self.sequence_parallel_module, device=self.root_device)

    def sequence_parallel_module(self) -> nn.Module:
        """The module whose sequence-parallel group the loaders split for (each strategy says which)."""
        raise NotImplementedError

    def setup_environment(self) -> None:
        super().setup_environment()
        names = self._fabric_names
        if self._resets_seed:
            # As DDPStrategy.setup_distributed: dropout masks and data made in train_dataloader() do not depend
            # on what building the model drew (Fabric's DDP does not reset).
            names.reset_seed()
        self._set_world_ranks()
        self._process_group_backend = self._process_group_backend or names.default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        creates_group = not names.distributed_is_initialized()
        names.init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        if creates_group:  # [Note: gloo at interpreter exit] in lightning/exit.py
            release_groups_at_exit(self._timeout)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        self._fabric_names.rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._fabric_names.distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._fabric_names.distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=self._fabric_names.group.WORLD)
        return box[0]

    def _reduce_tensor(self, tensor: Tensor | Any, group: Any | None, reduce_op: Any) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return self._fabric_names.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def _save_sharded(self, path: Path, module: nn.Module, optimizer: Any | None, meta: dict[str, Any]) -> None:
        """Collective: ``common.save_sharded`` with this strategy's rank-0 writer; the first save logs
        ``common.LOAD_HINT`` (how to load the directory without the strategy)."""
        common.save_sharded(
            path,
            module,
            optimizer,
            meta,
            is_rank0=self.is_global_zero,
            barrier=self.barrier,
            write=lambda obj, file: self.checkpoint_io.save_checkpoint(obj, file),
        )
        if not self._hinted:
            self._hinted = True
            self._fabric_names.rank_zero_info(common.LOAD_HINT.format(path=path))
