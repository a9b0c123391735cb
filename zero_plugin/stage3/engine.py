"""Stage 3: parameters, gradients and optimizer state all sharded (ZeRO paper, section 5.3).

Setup shards every parameter in place (see [Note: stage-3 parameter storage]
in ``param.py``), groups them into units (``policy.py``) and registers the
runtime hooks (``hooks.py``).  The optimizer steps the model's own parameter
objects, whose data is the local shard.

[Note: autograd through gathered parameters] Inside ``zp.gathered_parameters`` with grad enabled a
parameter of a unit the block gathered may be used in a graph (a regulariser on a weight, computed
outside its unit's forward).  Autograd saves a leaf parameter itself, not its value; the block reshards
it on exit, so backward would read the local shard (a size mismatch, or a wrong gradient).  While the
block runs, a saved parameter is packed as a copy of its full value instead; the gradient still flows
to the parameter (edges are not saved tensors), full-shaped as the unit's own, and is reduced with
them (a gradient arriving after its unit was reduced is reduced again in the final callback).  Costs a
copy of each saved parameter until backward, only inside such blocks.  Outside such a block, a
parameter used while its unit is sharded is an error in backward that names it ([Note: uses outside
the unit] in param.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from ..comm.collectives import Comm
from ..comm.streams import StreamSet, streams_for
from ..config import ZeroConfig
from ..engines.engine import Engine, EngineBasis
from ..engines.hostmem import choose_heap_trim, host_share_used, malloc_preloaded, trim_host_heap
from ..grads.presence import DeferredStores
from ..loading.materialize import ParamSource, owners_of, to_real
from ..loading.quantized import is_packed_4bit
from ..optim.master import MasterParam, copy_changed
from ..optim.offload import host_for
from ..tensors.flat import ShardLayout
from .accumulate import FullGradStore
from .hooks import Phase, Stage3Runtime
from .order import OrderGuard
from .param import ShardedParam, ShardedState
from .policy import assign_units, backward_reads_weights
from .pool import BufferPool
from .sliced import sliceable, sliced_unit_type
from .state_dict_hooks import StateDictHooks, gather_to_host
from .storage_pool import StoragePool, can_lend_storage
from .tag_check import TagChecks
from .unit import GatherMode, Unit, UnitServices, UnitSpec

__all__ = ["Stage3Engine", "build_stage3_engine", "unit_specs"]


def build_stage3_engine(
    model: nn.Module,
    trainable: list[tuple[str, nn.Parameter]],
    config: ZeroConfig,
    comm: Comm,
    param_source: ParamSource | None = None,
    engine_type: type[Stage3Engine] | None = None,
) -> Stage3Engine:
    """``engine_type``: :class:`Stage3Engine` (training) or ``stage3.inference.InferenceEngine``."""
    modules, owner = assign_units(model, config)
    trains = {id(p) for _, p in trainable}
    names = {id(p): n for n, p in model.named_parameters()}
    sharded: dict[int, ShardedParam] = {}
    per_unit: list[list[ShardedParam]] = [[] for _ in modules]
    all_params = list(model.parameters())
    trim = comm.device.type == "cpu" and config.stage3.trim_host_heap
    for index in range(len(modules)):  # one unit at a time: never the whole model unsharded
        params = [p for p in all_params if owner[id(p)] == index]
        for p, full in zip(params, _full_tensors(model, params, param_source, comm)):
            sp = _shard_one(p, names[id(p)], full, comm, config, trains=id(p) in trains)
            sharded[id(p)] = sp
            per_unit[index].append(sp)
        if trim:  # the unit's full tensors are freed: hand their pages back ([Note: heap trimming] in ``hostmem.py``)
            trim_host_heap()
    _broadcast_buffers(model, comm)
    specs = unit_specs(modules, per_unit, comm, config)
    services = UnitServices(
        guard=OrderGuard(comm, [spec.name for spec in specs]),  # [Note: collective order]; opens the channel
        tag_checks=TagChecks(),  # [Note: gather tag] in unit.py
        deferred=DeferredStores(),  # [Note: deferred has-gradient flags] in grads/presence.py
        pool=BufferPool(),  # one for all units: [Note: buffer reuse]
        streams=streams_for(comm.device),  # [Note: side streams] in ``streams.py``; no-op on CPU
        kept=FullGradStore() if config.stage3.accumulate_full_grads else None,  # [Note: deferred reduction]
    )
    units = [_make_unit(spec, services) for spec in specs]
    _lend_storage(units, config, comm.device)
    slots = [_master_for(sharded[id(p)], names[id(p)], config) for _, p in trainable]
    return (engine_type or Stage3Engine)(EngineBasis(model, config, comm, slots), units, sharded, services)


def unit_specs(
    modules: list[tuple[str, nn.Module]], params: list[list[ShardedParam]], comm: Comm, config: ZeroConfig
) -> list[UnitSpec]:
    """Every unit's record ([Note: unit record] in unit.py), in one place: its module and sharded parameters,
    the groups its collectives run on and ZeRO++'s switches.  Collective at setup (the reductions' sibling
    group, hpZ's node groups)."""
    reduce_comm = comm.sibling("stage-3 reductions")  # [Note: reductions on their own group] in hooks.py
    k = config.resolved_secondary_shard_size(comm.world_size) if comm.world is comm else None
    node = comm.node_group(k) if k is not None and comm.moves_data else None  # [Note: secondary shards]
    block = config.comm.quantization_block
    return [
        UnitSpec(
            index=index,
            name=name,
            module=module,
            params=params[index],
            comm=comm,
            reduce_comm=reduce_comm,
            reduce_dtype=config.effective_reduce_dtype,
            weight_block=block if config.comm.quantized_weights else None,  # [Note: qwZ gather]
            grad_block=block if config.comm.quantized_gradients else None,  # [Note: qgZ reduction]
            secondary_comm=node,
            slice_numel=config.stage3.linear_slice_numel,
            backward_reads_weights=index == 0 or backward_reads_weights(module),  # [Note: weights unread in backward]
        )
        for index, (name, module) in enumerate(modules)
    ]


def _make_unit(spec: UnitSpec, services: UnitServices) -> Unit:
    if spec.index and sliceable(
        spec.module, [sp.param for sp in spec.params], spec.slice_numel, _full_weight_numel(spec.module, spec.params)
    ):  # [Note: sliced linear units]
        return sliced_unit_type(spec.module)(spec, services)
    return Unit(spec, services)


def _lend_storage(units: list[Unit], config: ZeroConfig, device: torch.device) -> None:
    """[Note: lent storage] in storage_pool.py: one pool for every unit.  What it keeps unlent is bounded by the
    gathers in flight at once (the unit in use and its prefetches) of the largest unit, and a storage not
    lent again within as many units' worth of lends is let go."""
    if not can_lend_storage(device) or malloc_preloaded():  # another allocator reuses the blocks itself
        return
    in_flight = config.stage3.prefetch_depth + 1
    largest = max((sum(sp.layout.numel * sp.unsharded.element_size() for sp in u.params) for u in units), default=0)
    most_params = max((len(u.params) for u in units), default=0)
    pool = StoragePool(max_free_bytes=largest * in_flight, max_idle_lends=most_params * in_flight)
    for unit in units:
        for sp in unit.params:
            sp.storage_pool = pool


def _full_weight_numel(module: nn.Module, params: list[ShardedParam]) -> int:
    """The unsharded element count of ``module.weight`` (the module holds only this rank's shard)."""
    weight = getattr(module, "weight", None)
    return next((sp.layout.numel for sp in params if sp.param is weight), 0)


@torch.no_grad()
def _full_tensors(
    model: nn.Module, params: list[nn.Parameter], source: ParamSource | None, comm: Comm
) -> list[torch.Tensor]:
    """Full values of one unit's parameters: the live data, or fresh tensors filled from ``source``."""
    meta = [p for p in params if p.is_meta]
    if meta and source is None:
        name = owners_of(model, meta[:1])[0][2]
        raise ValueError(
            f"zp.setup: parameter {name!r} is on the meta device; pass param_source= (a safetensors "
            "path, zp.materialize.from_init_fn(...), or a fill function) so it can be materialised"
        )
    fulls = {id(p): torch.empty(p.shape, dtype=p.dtype) for p in meta}
    if meta and comm.world.rank == 0:  # other ranks receive rank 0's values in the broadcast
        owners = owners_of(model, meta)
        source.fill([(m, a, n, fulls[id(p)]) for (m, a, n), p in zip(owners, meta)])
    for p in meta:
        if p.is_meta:
            to_real(p, fulls[id(p)])
    return [fulls.get(id(p), p.data) for p in params]


def _master_for(sp: ShardedParam, name: str, config: ZeroConfig) -> MasterParam:
    """The shard itself, or (offload to a host distinct from the device) a copy on the host: in
    ``master_dtype`` under ``param_dtype``, else in the shard's own dtype (a float64 model keeps float64
    masters, as at stages 0-2)."""
    master_device = host_for(sp.local.device) if config.offload.optimizer == "cpu" else None
    if master_device is None and (
        config.precision.param_dtype is None or sp.local.dtype == config.precision.master_dtype
    ):
        return MasterParam(name, sp.param, sp.layout, sp.param, None)
    master_dtype = config.precision.master_dtype if config.precision.param_dtype is not None else None
    return MasterParam(name, sp.param, sp.layout, sp.local, master_dtype, master_device=master_device)


@torch.no_grad()
def _shard_one(
    p: nn.Parameter, name: str, full: torch.Tensor, comm: Comm, config: ZeroConfig, trains: bool
) -> ShardedParam:
    device = comm.device
    full = full.to(device).contiguous()
    comm.world.broadcast(full, src=0)  # every rank starts from rank 0's values (DDP semantics), replicas too
    floating = p.dtype.is_floating_point and not is_packed_4bit(
        p
    )  # [Note: packed 4-bit weights] in ``quantized.py``: never cast
    compute = (config.precision.param_dtype or p.dtype) if floating else p.dtype
    # The shard doubles as the fp32 master unless offload moves the master to another device.
    offload_master = config.offload.optimizer == "cpu" and host_for(device) is not None
    keeps_master = floating and trains and config.precision.param_dtype is not None and not offload_master
    storage = config.precision.master_dtype if keeps_master else compute
    storage_device = host_for(device) if config.offload.params else None
    layout = ShardLayout(full.numel(), comm.world_size, comm.rank)
    return ShardedParam(
        p, name, full, layout, storage_dtype=storage, compute_dtype=compute, storage_device=storage_device
    )


@torch.no_grad()
def _broadcast_buffers(model: nn.Module, comm: Comm) -> None:
    world = comm.world  # replicas too: [Note: hierarchical groups]
    if world.world_size > 1:
        world.coalesced(list(model.buffers()), lambda flat: world.broadcast(flat, src=0))


class Stage3Engine(Engine):
    grads_sharded = True
    runtime_type = Stage3Runtime  # the inference engine's forward-only runtime: stage3/inference.py

    def __init__(
        self, basis: EngineBasis, units: list[Unit], sharded: dict[int, ShardedParam], services: UnitServices
    ) -> None:
        super().__init__(basis)
        model, config, comm, slots = basis.model, basis.config, basis.comm, basis.slots
        self.units = units
        self.sharded = sharded
        self.unit_of = {id(sp.param): u for u in units for sp in u.params}
        self._slot_of = {id(s.param): s for s in slots}
        self.runtime = self.runtime_type(
            units,
            services,
            config.stage3.prefetch_depth,
            config.stage3.reshard_after_forward,
            trim_heap=choose_heap_trim(
                config.stage3.trim_host_heap,
                comm.device.type == "cpu",
                config.stage3.trim_each_unit_above,
                host_share_used(config.local_processes(default=comm.world_size)),
            ),
            storage_pool=next((sp.storage_pool for sp in sharded.values() if sp.storage_pool), None),
            after_backward=self.after_backward,
        )
        self.runtime.register()
        self.state_dict_hooks = StateDictHooks(self)  # [Note: stage-3 state dicts]
        self.state_dict_hooks.register()
        _mark_for_synced_generate(model, comm)

    @property
    def compute_device(self) -> torch.device:
        return self.comm.device  # where units are gathered and computed

    @property
    def storage_pool(self) -> StoragePool | None:
        return self.runtime.storage_pool  # [Note: lent storage] in storage_pool.py

    def in_backward(self) -> bool:
        return self.runtime.phase is Phase.BACKWARD

    def open_blocks(self) -> int:
        return self.runtime.open_blocks  # zp.gathered_parameters blocks: [Note: pending forward] in hooks.py

    def set_streams(self, streams: StreamSet) -> None:
        """Replace every unit's side streams, between steps ([Note: side streams] in streams.py): tests
        substitute a recording fake, or ``NO_STREAMS`` to run everything on the compute stream."""
        for unit in self.units:
            unit.set_streams(streams)

    # -- step ---------------------------------------------------------------------
    def owned_grad(self, slot: MasterParam) -> torch.Tensor | None:
        return self.sharded[id(slot.param)].sharded_grad

    def owned_grads(self) -> list[torch.Tensor]:
        self._check_reduced("the gradient norm (clip_grad_norm_) or the inf/NaN check")
        return super().owned_grads()

    def _check_reduced(self, verb: str) -> None:
        if self.runtime.kept is not None:  # [Note: deferred reduction] in accumulate.py
            self.runtime.kept.check_reduced(verb)

    def before_step(self, blocked: bool = False, slots: list[MasterParam] | None = None) -> None:
        self._check_reduced("optimizer.step()")
        self.forget_forward()  # units kept gathered for a backward that did not come: [Note: pending forward]
        for slot in self.slots if slots is None else slots:  # [Note: several optimizers] in engines/engine.py
            grad = self.sharded[id(slot.param)].sharded_grad
            if slot.is_identity:
                slot.param.grad = grad
            else:
                slot.set_grad(grad, blocked)
        if not blocked:  # the blocked step waits for each host copy itself
            self.wait_for_host_copies()

    def after_step(self, slots: list[MasterParam] | None = None) -> None:
        for slot in self.slots if slots is None else slots:
            slot.param.grad = None
            self.sharded[id(slot.param)].sharded_grad = None
            if not slot.is_identity:
                slot.write_back()
                slot.master.grad = None

    def discard_grads(self, set_to_none: bool, slots: list[MasterParam] | None = None) -> None:
        if self.runtime.kept is not None and slots is None:
            self.runtime.kept.discard()
        for slot in self.slots if slots is None else slots:
            sp = self.sharded[id(slot.param)]
            slot.param.grad = None
            if set_to_none or sp.sharded_grad is None:
                sp.sharded_grad = None
            else:
                sp.sharded_grad.zero_()

    def accumulator(self) -> Any:
        # Reduce-scatter every micro-batch into the shard gradients (the sum is the same), or with
        # ZeroConfig.accumulate_full_grads keep the full gradients until the synced backward.
        return self.runtime

    def forget_forward(self) -> None:
        """Before the step or a write to the shards: [Note: pending forward] in hooks.py (inside a
        ``zp.gathered_parameters`` block the runtime waits for the outermost exit)."""
        self.runtime.forget_forward()

    # -- gathering ----------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
        units = sorted(
            {self.unit_of[id(p)].index: self.unit_of[id(p)] for p in params if id(p) in self.unit_of}.values(),
            key=lambda u: u.index,
        )
        opened = [u for u in units if u.state is ShardedState.SHARDED]
        for u in opened:
            u.unshard(GatherMode.EXACT)  # the shards' own values, also under qwZ / hpZ (ZeRO++)
            u.tag_checks.flush()  # the user reads (and may edit) them now: [Note: gather tag] in unit.py
        # [Note: gathered edits] in optim/master.py: each rank's region as gathered, to find edited elements.
        before = (
            {id(sp): sp.layout.local_view(sp.param.data.reshape(-1)).clone() for u in units for sp in u.params}
            if modifier_rank is not None
            else {}
        )
        saved = _keep_saved_values([sp.param for u in opened for sp in u.params])
        self.runtime.open_block()
        try:
            with saved:
                yield
        finally:
            with torch.no_grad():
                if modifier_rank is not None:
                    for u in units:
                        for sp in u.params:
                            self.comm.world.broadcast(sp.param.data, src=modifier_rank)
                            self._take_edits(sp, before[id(sp)])
            for u in opened:
                u.reshard()
            self.runtime.close_block(wrote=modifier_rank is not None)  # edits are writes: [Note: pending forward]

    def _take_edits(self, sp: ShardedParam, before: torch.Tensor) -> None:
        """The edited elements of this rank's region into the shard and, if separate, the master."""
        now = sp.layout.local_view(sp.param.data.reshape(-1))
        copy_changed(sp.local, now, before)
        slot = self._slot_of.get(id(sp.param))
        if slot is not None and not slot.is_identity:
            copy_changed(slot.master, now, before)

    # -- state dicts --------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = True, trainable_only: bool = False) -> dict:
        """One parameter at a time, from the shards in their stored precision (fp32 masters when
        ``param_dtype`` is lower): rank 0's peak is one full model plus one parameter."""
        masters = {id(s.param): s.master for s in self.slots if not s.is_identity}
        keep = {id(s.param) for s in self.slots} if trainable_only else None
        names = _all_names(self.model)
        out: dict[str, torch.Tensor] = {}
        want = not rank0_only or self.comm.world.rank == 0
        for sp in self.sharded.values():
            if keep is not None and id(sp.param) not in keep:
                continue
            value = gather_to_host(self.comm, masters.get(id(sp.param), sp.local), sp, self.compute_device)
            if want:
                for n in names[id(sp.param)]:
                    out[n] = value
        if not want:
            return {}
        ordered = {}
        param_ids = {id(p) for p in self.model.parameters()}
        with self.state_dict_hooks.raw():  # torch's keys and order, the model's own objects
            entries = self.model.state_dict(keep_vars=True)
        for k, v in entries.items():  # model.state_dict() key order
            if k in out:
                ordered[k] = out[k]
            elif keep is None and id(v) not in param_ids:
                ordered[k] = v.detach().cpu().clone()
        return ordered

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        names = _all_names(self.model)
        missing = []
        for sp in self.sharded.values():
            key = next((n for n in names[id(sp.param)] if n in state_dict), None)
            if key is None:
                missing.extend(names[id(sp.param)][:1])
                continue
            value = state_dict[key]
            if tuple(value.shape) != sp.shape:
                raise ValueError(
                    f"zp.load_full_state_dict: {key!r} has shape {tuple(value.shape)}, the model expects {sp.shape}"
                )
        if strict and missing:
            raise ValueError(f"zp.load_full_state_dict: missing keys {missing[:5]}; pass strict=False to skip them")
        self.forget_forward()  # a write to the shards: [Note: pending forward] in hooks.py
        masters = {id(s.param): s for s in self.slots if not s.is_identity}
        for sp in self.sharded.values():
            key = next((n for n in names[id(sp.param)] if n in state_dict), None)
            if key is not None:
                sp.write_full_into_local(state_dict[key].to(sp.local.dtype))
                if id(sp.param) in masters:
                    slot = masters[id(sp.param)]
                    region = sp.layout.local_view(state_dict[key].detach().reshape(-1).contiguous())
                    slot.master.copy_(region.reshape(slot.master.shape))
        param_ids = {id(p) for p in self.model.parameters()}
        with self.state_dict_hooks.raw():
            entries = self.model.state_dict(keep_vars=True)
        for k, v in entries.items():
            if id(v) not in param_ids and k in state_dict:
                v.data.copy_(state_dict[k])
        return None

    def full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        sp = self.sharded.get(id(param))
        return sp.shape if sp is not None else tuple(param.shape)

    def full_numel(self, param: nn.Parameter) -> int:
        sp = self.sharded.get(id(param))
        return sp.layout.numel if sp is not None else param.numel()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = [sp.local for sp in self.sharded.values()] + [sp.unsharded for sp in self.sharded.values()]
        grads = [sp.sharded_grad for sp in self.sharded.values() if sp.sharded_grad is not None]
        grads += [sp.param.grad for sp in self.sharded.values() if sp.param.grad is not None]
        grads += self.runtime.kept.tensors() if self.runtime.kept is not None else []
        return {"params": params, "grads": grads, "masters": []}

    def unsharded_units(self) -> list[Unit]:
        return [u for u in self.units if u.state is ShardedState.UNSHARDED]

    def remove(self) -> None:
        self.runtime.remove()
        for unit in self.units:
            unit.remove()
        self.state_dict_hooks.remove()
        super().remove()


def _keep_saved_values(params: list[nn.Parameter]):
    """Pack saved ``params`` as copies of their full values while the block runs ([Note: autograd through
    gathered parameters])."""
    if not params or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    ids = {id(p) for p in params}

    def pack(t: torch.Tensor):
        return t.detach().clone() if id(t) in ids else t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _mark_for_synced_generate(model: nn.Module, comm: Comm) -> None:
    """Every stage-3 forward is collective, so a rank that finished generating
    must keep running forwards until all have.  transformers' ``generate`` does that (``synced_gpus``)
    for modules carrying ``_is_fsdp_managed_module``; we set it on the model's transformers modules."""
    if comm.world.world_size == 1:
        return
    for module in model.modules():
        if hasattr(module, "generate"):
            module._is_fsdp_managed_module = True


def _all_names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names
