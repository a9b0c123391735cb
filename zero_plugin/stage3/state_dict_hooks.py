"""Stage 3: ``module.state_dict()`` and ``module.load_state_dict()`` see full tensors.

[Note: stage-3 state dicts]
Between uses a stage-3 parameter's data is this rank's 1-D shard ([Note: stage-3 parameter storage] in
``param.py``), so torch's own ``state_dict()`` would return shards and ``save_pretrained`` would write them
without a word.  Hooks registered with torch's module API on every module of the set-up model make both
directions full-shaped, whichever module the call starts from (``model.state_dict()``,
``model.model.state_dict()``, PEFT's call on the base model, ``state_dict(prefix=...)``): torch runs a
module's hooks for every ``state_dict()`` / ``load_state_dict()`` that reaches it, also from a parent.

* ``state_dict()``: each module's post-hook replaces the entries of the parameters it holds directly by
  full tensors on the CPU, gathered one parameter at a time from the shards in their stored precision (the
  fp32 master when it is a separate tensor), so the device holds one padded parameter above the shards at
  any time and the result grows on the host.  Keys and order are torch's; a tied parameter is gathered once
  and its keys share one tensor (as torch's entries share storage, which ``save_pretrained`` relies on to
  drop the tied copy).  ``keep_vars=True`` gives a new ``nn.Parameter`` holding the full value with the
  original ``requires_grad``, not the model's own object (that holds a shard).  Values are copies taken at
  the call, not views of live parameters.  Buffers are not sharded: they are left as torch returns them.
  With ``ZeroConfig.state_dict_rank0_only`` every rank takes part in the gathers but only rank 0 keeps
  the result; the other ranks get ``{}`` (everything under the call's prefix removed).
* ``load_state_dict(full)``: each module's pre-hook, for the parameters it holds directly, checks the full
  shape (torch's "size mismatch" message, with the full shape) and hands torch this rank's region of the
  value instead, so torch's own copy, ``strict`` handling and ``_IncompatibleKeys`` result apply; a
  separate fp32 master gets the region from the value itself (no precision lost).  A unit gathered at the
  time (inside ``zp.gathered_parameters``) gets the full value as well.  ``assign=True`` is refused:
  it would replace the parameter objects the engine shards.

Both are collective at stage 3 (the gathers; a load changes every rank's region), so the first hooked
module of each call runs a blocking agreement on the control channel ([Note: collective order] in
``order.py``): every rank must be in the same call.  A rank left alone waits at most
``ZeroConfig.timeout_s`` and raises an error naming ``state_dict`` and the fix; a peer in a forward sees
a mismatch and both raise.  After the agreement every rank runs the same traversal, so the gathers pair.
A call on a module with no sharded parameter below it is torch's own, with no collective.

Internal callers that want torch's raw result (the sharded checkpoint's buffer list, ``zp.full_state_dict``'s
key order) run inside :meth:`StateDictHooks.raw`.  A call abandoned by an exception (a user hook raising)
leaves a stale stack: the next call's first module is not below its top (in the live module tree), which
starts a fresh call.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from ..comm.layout import layout_of
from .order import LOAD_STATE_DICT, STATE_DICT
from .param import ShardedParam, ShardedState

if TYPE_CHECKING:
    from .engine import Stage3Engine

__all__ = ["StateDictHooks", "gather_to_host"]

# Kinds of control messages, beside the order guard's 1-3 ([Note: collective order] in order.py).
_SAVE, _LOAD = STATE_DICT, LOAD_STATE_DICT
_KINDS = {
    1.0: "is in a forward (gathering a unit)",
    2.0: "is ending a forward",
    3.0: "is ending a backward",
    _SAVE: "is in state_dict()",
    _LOAD: "is in load_state_dict()",
}


@torch.no_grad()
def gather_to_host(comm, source: torch.Tensor, sp: ShardedParam, device: torch.device) -> torch.Tensor:
    """Collective: every rank's region of ``sp`` (``source``: this rank's region, the shard or its master)
    as one full tensor on the CPU, gathered on ``device`` (the shards may live on the host with
    ``offload_params``) by the group's layout (``Layout.gather_shards``: in place on gloo, nothing but the
    result allocated) and copied once to a fresh host tensor unless it is one already."""
    layout, flat = sp.layout, source.detach().reshape(-1)
    if comm.world_size == 1:
        return flat.to("cpu", copy=True).view(sp.shape)
    full = layout_of(comm).gather_shards(comm, flat, layout, device, tag=f"state_dict {sp.name}")
    if full.device.type == "cpu" and full.numel() == layout.numel:
        return full.view(sp.shape)
    return full[: layout.numel].to("cpu", copy=True).view(sp.shape)


class _Call:
    """One ``state_dict()`` or ``load_state_dict()`` in progress: the modules entered, outermost first."""

    def __init__(self, kind: float, verb: str) -> None:
        self.kind, self.verb = kind, verb
        self.stack: list[nn.Module] = []
        self.keep_vars = False
        self.values: dict[int, torch.Tensor | None] = {}  # id(param) -> its full value (tied keys share it)


class StateDictHooks:
    """The four module hooks of [Note: stage-3 state dicts], on every module of one stage-3 model."""

    def __init__(self, engine: Stage3Engine) -> None:
        self.engine = engine
        self.raw_depth = 0
        self._save = _Call(_SAVE, "state_dict")
        self._load = _Call(_LOAD, "load_state_dict")
        self._masters: dict[int, torch.Tensor] = {}  # separate fp32 masters, taken at the start of each call
        # id(module) of the modules with a sharded parameter at or below them
        self._covers = {id(m) for m in engine.model.modules() if any(id(p) in engine.sharded for p in m.parameters())}
        self._keys_only = _peft_modules_to_save(engine.model)
        self._handles: list = []

    def register(self) -> None:
        # partials, not bound methods: torch marks a public post-hook with an attribute
        for module in self.engine.model.modules():
            self._handles += [
                module.register_state_dict_pre_hook(functools.partial(StateDictHooks._pre_save, self)),
                _register(
                    module,
                    "register_state_dict_post_hook",
                    "_register_state_dict_hook",
                    functools.partial(StateDictHooks._post_save, self),
                ),
                _register(
                    module,
                    "register_load_state_dict_pre_hook",
                    "_register_load_state_dict_pre_hook",
                    functools.partial(StateDictHooks._pre_load, self),
                    with_module=True,
                ),
                module.register_load_state_dict_post_hook(functools.partial(StateDictHooks._post_load, self)),
            ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def raw(self) -> Iterator[None]:
        """Inside, ``state_dict()`` / ``load_state_dict()`` are torch's own: this rank's shards, no collective."""
        self.raw_depth += 1
        try:
            yield
        finally:
            self.raw_depth -= 1

    # -- state_dict ---------------------------------------------------------------------------------------------
    def _pre_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._enter(self._save, module):
            self._save.keep_vars = keep_vars

    def _post_save(self, module: nn.Module, destination: dict, prefix: str, local_metadata: dict) -> None:
        call = self._save
        if not call.stack or call.stack[-1] is not module:
            return
        keep = self._keeps_result()
        for name, p in module._parameters.items():
            sp = self.engine.sharded.get(id(p)) if p is not None else None
            key = prefix + name
            if sp is None or key not in destination:
                continue
            value = self._full_value(call, sp, keep)
            if keep:
                destination[key] = value
            else:
                del destination[key]
        call.stack.pop()
        if not call.stack:
            call.values.clear()
            if not keep:
                for key in [k for k in destination if k.startswith(prefix)]:
                    del destination[key]

    def _keeps_result(self) -> bool:
        return not self.engine.config.stage3.state_dict_rank0_only or self.engine.comm.world.rank == 0

    def _full_value(self, call: _Call, sp: ShardedParam, keep: bool) -> torch.Tensor | None:
        """Gathered once per call (a tied parameter's second key reuses it, on every rank alike: the gathers
        pair); ``None`` where the result is not kept."""
        if id(sp.param) in call.values:
            return call.values[id(sp.param)]
        source = self._masters.get(id(sp.param), sp.local)
        value = gather_to_host(self.engine.comm, source, sp, self.engine.compute_device)
        if not keep:
            value = None
        elif call.keep_vars:
            value = nn.Parameter(value, requires_grad=sp.param.requires_grad)
        call.values[id(sp.param)] = value
        return value

    # -- load_state_dict ----------------------------------------------------------------------------------------
    def _pre_load(
        self,
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        if not self._enter(self._load, module):
            return
        if len(self._load.stack) == 1:  # the call's first module: a write to the shards, [Note: pending forward]
            self.engine.forget_forward()
        for name, p in module._parameters.items():
            sp = self.engine.sharded.get(id(p)) if p is not None else None
            key = prefix + name
            if sp is None or not isinstance(state_dict.get(key), torch.Tensor):
                continue  # missing and unexpected keys: torch's own handling
            if local_metadata.get("assign_to_params_buffers", False):
                raise ValueError(
                    f"load_state_dict(assign=True) is not supported at stage 3 ({key!r}): it would replace the "
                    "parameter objects zero_plugin shards; call load_state_dict(state_dict) without assign"
                )
            state_dict[key] = self._region_to_load(sp, state_dict[key], key, error_msgs)

    @torch.no_grad()
    def _region_to_load(self, sp: ShardedParam, value: torch.Tensor, key: str, error_msgs: list) -> torch.Tensor:
        """What torch should copy into ``param`` (whose data is this rank's shard, or the full tensor while
        its unit is gathered); the master, if separate, takes its region here."""
        if tuple(value.shape) != sp.shape:
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {value.shape} from "
                f"checkpoint, the shape in current model is {torch.Size(sp.shape)}."
            )
            return sp.param.detach()  # nothing to copy: torch's copy of the parameter onto itself
        region = sp.layout.local_view(value.detach().reshape(-1))
        master = self._masters.get(id(sp.param))
        if master is not None:
            master.copy_(region.reshape(master.shape))
        if sp.state is ShardedState.UNSHARDED and not sp.lent:
            sp.write_full_into_local(value)
            return value  # torch copies it into the gathered full tensor
        return region

    def _post_load(self, module: nn.Module, incompatible_keys) -> None:
        call = self._load
        if call.stack and call.stack[-1] is module:
            call.stack.pop()

    # -- calls --------------------------------------------------------------------------------------------------
    def _enter(self, call: _Call, module: nn.Module) -> bool:
        """Push ``module``; at the first module of a call that covers sharded parameters, agree with the peers.
        False when the hooks leave this call to torch."""
        if self.raw_depth:
            return False
        if call.stack and not _strictly_inside(module, call.stack[-1]):
            call.stack.clear()  # a call abandoned by an exception: this is a new one
            call.values.clear()
        if not call.stack:
            if id(module) not in self._covers:
                return False
            if call is self._save and id(module) in self._keys_only:
                return False  # PEFT reads only the keys here, on the main process alone: _peft_modules_to_save
            self._agree(call)
            self._masters = {id(s.param): s.master for s in self.engine.slots if not s.is_identity}
        call.stack.append(module)
        return True

    def _agree(self, call: _Call) -> None:
        """Blocking: every rank is in the same kind of call ([Note: stage-3 state dicts])."""
        guard = self.engine.runtime.guard
        if not guard.active:
            return
        guard.settle()
        comm = self.engine.comm
        message = (call.kind, 0.0, 0.0) + (0.0,) * len(guard.names)  # the guard's message length
        try:
            seen = comm.control_exchange(message, f"agreement on {call.verb}()")
        except RuntimeError as exc:
            raise RuntimeError(self._alone_message(call, exc)) from exc
        if any(m[:3] != message[:3] for m in seen):
            comm.control_objects([])  # a peer in the order guard lists the units it ran: answer it, none here
            doing = "; ".join(f"rank {r} {_KINDS.get(m[0], 'is elsewhere')}" for r, m in enumerate(seen))
            raise RuntimeError(
                f"zero_plugin stage 3: {call.verb}() was called on some ranks only ({doing}). {call.verb}() of "
                f"a stage-3 model is collective: {_FIX}"
            )

    def _alone_message(self, call: _Call, exc: Exception) -> str:
        comm = self.engine.comm
        return (
            f"zero_plugin stage 3: rank {comm.rank} called {call.verb}() but not every rank did within "
            f"ZeroConfig.timeout_s={self.engine.config.comm.timeout_s:g} s ({exc.__cause__ or exc}). "
            f"{call.verb}() of a stage-3 model is collective (it gathers or updates the sharded "
            f"parameters): {_FIX}"
        )


def _register(module: nn.Module, public: str, private: str, hook, **private_kwargs):
    """torch >= 2.5 has the public name; 2.4 (our oldest) only the private one, same call for our hooks
    (the post-hook returns None: the dict it edited in place is kept)."""
    if hasattr(module, public):
        return getattr(module, public)(hook)
    return getattr(module, private)(hook, **private_kwargs)


def _strictly_inside(module: nn.Module, ancestor: nn.Module) -> bool:
    return module is not ancestor and any(m is module for m in ancestor.modules())


_FIX = (
    "call it on every rank at the same point, e.g. outside `if is_main_process:` -- save_pretrained("
    "..., is_main_process=...) is called on every rank and writes on the main one; set ZeroConfig("
    "state_dict_rank0_only=True) to keep the gathered result on rank 0 only, or use zp.full_state_dict("
    "model) (also on every rank)."
)


def _peft_modules_to_save(model: nn.Module) -> set[int]:
    """``id`` of the modules under PEFT's ``ModulesToSaveWrapper.modules_to_save`` copies.  PEFT's
    ``get_peft_model_state_dict`` (so ``save_pretrained(..., state_dict=...)``, typically on the main process
    only, after ``accelerator.get_state_dict``) calls ``modules_to_save[adapter].state_dict()`` for its *keys*
    alone, and takes the values from the state dict it was given or from the whole model's.  A collective
    gather there would wait for peers that never call it; torch's own state dict (this rank's shards) has the
    same keys.  A direct call on such a copy returns shards (documented limit)."""
    out: set[int] = set()
    for module in model.modules():
        if type(module).__name__ == "ModulesToSaveWrapper":
            copies = getattr(module, "modules_to_save", None)
            if isinstance(copies, nn.Module):
                out.update(id(m) for m in copies.modules() if m is not copies)
    return out
