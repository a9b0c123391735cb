"""Rank functions for ``test_lightning_meta.py``: Lightning models built on the meta device.

Each returns plain Python / CPU tensors; full states are gathered on rank 0 ({} elsewhere).
"""

from __future__ import annotations

import functools
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

import zero_plugin as zp
from tests import models
from tests.integrations import lightning_fabric_workers as fw
from tests.integrations import lightning_workers as lw
from tests.integrations.lightning_setup import cpu_fabric, lightning_ranks


def save_weights(path: str, layers: int = 2) -> None:
    """Rank 0 writes the seed-0 tiny Llama with ``save_pretrained`` (safetensors, tied LM head left out)."""
    if dist.get_rank() == 0:
        models.make_tiny_llama(seed=0, layers=layers).save_pretrained(path, safe_serialization=True)
    dist.barrier()


def _probe(net: nn.Module) -> dict:
    """What the strategy built: meta parameters, real buffers."""
    return {
        "params_meta": all(p.is_meta for p in net.parameters()),
        "buffers_real": all(not b.is_meta for b in net.buffers()),
        "rng": torch.get_rng_state(),
    }


def _tied(net: nn.Module) -> bool:
    inner = net.base_model.model if hasattr(net, "peft_config") else net
    return inner.lm_head.weight is inner.model.embed_tokens.weight


# -- Trainer: configure_model ------------------------------------------------------------------------------
@functools.cache
def _meta_module_class(bad: bool = False):
    class MetaLlamaModule(lw._module_class()):
        """configure_model builds the net (on meta at stage 3); the initial weights are read at on_fit_start."""

        def __init__(self, kind: str = "llama") -> None:
            super().__init__(kind)
            self.configure_calls = 0
            self.built: dict = {}

        def configure_model(self) -> None:
            self.configure_calls += 1
            if self.net is not None:  # idempotent, as Lightning asks
                return
            net = lw.build_net(self.kind)
            if bad:
                net.model.extra = _NoInit()
            self.net = net
            self.built = _probe(net)

        def on_fit_start(self) -> None:  # after strategy.setup: materialised and sharded
            self.init_state = zp.full_state_dict(self)
            self.built["tied_after_setup"] = _tied(self.net)

    return MetaLlamaModule


class _NoInit(nn.Module):
    """Owns a parameter and has neither reset_parameters nor a transformers _init_weights for it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def trainer_meta_worker(strategy_kwargs: dict, validate: bool = False, bad: bool = False) -> dict:
    from zero_plugin.integrations.lightning import ZeroStrategy

    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        module = _meta_module_class(bad)("llama")
        trainer = lw.make_trainer(ZeroStrategy(**strategy_kwargs), root, max_epochs=1)
        try:
            trainer.fit(module, lw.loader(3 * lw.ACCUM))
        except ValueError as exc:
            return {"error": str(exc)}
        out = lw._result(trainer, module, built={k: v for k, v in module.built.items() if k != "rng"})
        if validate:
            out["val"] = trainer.validate(module, lw.loader(2, seed=1), verbose=False)
            out["configure_calls"] = module.configure_calls
        if dist.get_rank() == 0:
            out["rotary"] = dict(module.net.named_buffers())["model.rotary_emb.inv_freq"].clone()
        return out


# -- Fabric: init_module ---------------------------------------------------------------------------------------
def _fabric(strategy_kwargs: dict):
    from zero_plugin.integrations.lightning import ZeroFabricStrategy

    return cpu_fabric(ZeroFabricStrategy(**strategy_kwargs))


def fabric_meta_worker(strategy_kwargs: dict, empty_init: bool | None = True, steps: int = 3) -> dict:
    with lightning_ranks():
        fabric = _fabric(strategy_kwargs)
        with fabric.init_module(empty_init=empty_init):
            net = lw.build_net("llama")
        built = _probe(net)
        model, opt = fabric.setup(net, lw.make_optimizer(net.parameters()))
        init = zp.full_state_dict(net)
        tied = _tied(net)
        batches = models.make_batches("llama", steps * lw.ACCUM, 2, lw.PER_RANK_BATCH, seed=0)
        losses: list = []
        fw.fabric_train(fabric, model, opt, batches, losses, [])
        return {
            "losses": losses,
            "init": init,
            "state": zp.full_state_dict(net),
            "tied": tied,
            "built": {k: v for k, v in built.items() if k != "rng"},
        }


def empty_init_worker(preset: str) -> dict:
    """What ``init_module(empty_init=...)`` builds, Trainer and Fabric: meta or not, and whether the
    ``torch.nn.init`` calls drew from the generator (they do not when skipped, nor on meta)."""
    from zero_plugin.integrations.lightning import ZeroStrategy

    out = {}
    with lightning_ranks(), tempfile.TemporaryDirectory() as root:
        fabric = _fabric({"config": preset})
        trainer = lw.make_trainer(ZeroStrategy(config=preset), root)
        for api, enter in (("fabric", fabric.init_module), ("trainer", trainer.init_module)):
            for empty_init in (None, True, False):
                before = torch.get_rng_state()
                with enter(empty_init=empty_init):
                    probe = _probe(nn.Linear(8, 8))
                out[(api, empty_init)] = {"meta": probe["params_meta"], "drew": not torch.equal(before, probe["rng"])}
    return out


# -- memory during setup -------------------------------------------------------------------------------------
def _bigger_llama():
    """~6.6M parameters (26 MB fp32): 8 decoder layers of ~0.79M, a tied 1024 x 256 embedding."""
    from transformers import LlamaForCausalLM

    config = models.llama_config(
        1024, 256, intermediate=688, layers=8, heads=8, kv_heads=4, tie=True, attn_implementation="eager"
    )
    return LlamaForCausalLM(config)


def _peak_bytes(prof) -> int:
    """Peak of live CPU bytes allocated inside the profiled window, from the allocation and free events."""
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def setup_memory_worker(meta_init: bool) -> dict:
    """Peak bytes allocated while building (init_module) and setting up a stage-3 model, against its sizes."""
    with lightning_ranks():
        fabric = _fabric({"config": "zero3", "meta_init": meta_init})
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with fabric.init_module():
                net = _bigger_llama()
            fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
        engine = zp.engines.engine.engine_of(net, "test")
        unit_bytes = [sum(sp.layout.numel * sp.param.element_size() for sp in u.params) for u in engine.units]
        shard_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
        return {"peak": _peak_bytes(prof), "full": sum(unit_bytes), "max_unit": max(unit_bytes), "shard": shard_bytes}


def init_stats(state: dict) -> dict:
    """Per kind of tensor, what transformers' Llama init gives: norms 1, matrices normal(0, 0.02)."""
    norms = [v for k, v in state.items() if k.endswith("norm.weight")]
    mats = torch.cat([v.reshape(-1) for k, v in state.items() if v.ndim == 2])
    return {
        "norms_one": all(bool((v == 1).all()) for v in norms) and bool(norms),
        "std": float(mats.std()),
        "mean": float(mats.mean()),
        "finite": all(bool(torch.isfinite(v).all()) for v in state.values()),
    }
