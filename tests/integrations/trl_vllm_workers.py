"""Functions that run inside the ranks of ``test_trl_vllm_sync.py``: TRL's own vLLM server-mode weight sync
(``trl.generation.vllm_generation.VLLMGeneration.sync_weights``) driven into a recording stub client, after one
training step, against the same sync on an unsharded copy of the trained model.

Module-level so the worker pool pickles them by reference.  vLLM is not installed: the ``VLLMGeneration`` is
built without its ``__init__`` (which starts a vLLM client), with exactly the attributes ``sync_weights`` reads.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests import models


class RecordingClient:
    """Stands in for ``trl.generation.vllm_client.VLLMClient``: what ``sync_weights`` calls on it.  Records each
    pushed tensor (a copy: the pushed one is released with its unit) and, through ``watch``, what was gathered
    at that moment."""

    def __init__(self, watch=None) -> None:
        self.metadata: list | None = None
        self.received: dict[str, torch.Tensor] = {}
        self.gathered: list = []
        self.watch = watch

    def update_named_params(self, metadata, named_params) -> None:
        self.metadata = metadata
        for name, tensor in named_params:
            self.received[name] = tensor.detach().clone()
            if self.watch is not None:
                self.gathered.append((name, self.watch()))

    def reset_prefix_cache(self) -> None:
        pass


def _generation(model, client: RecordingClient | None):
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    accelerator = SimpleNamespace(
        is_main_process=client is not None, state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None)
    )
    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.model, generation.accelerator, generation._dist = model, accelerator, DistributedBackend(accelerator)
    generation.mode, generation.enable_sleep_mode, generation._weight_metadata = "server", False, None
    generation.vllm_client = client
    return generation


def _model(lora: bool):
    model = models.make_real_llama()
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(1)
        model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # non-zero adapters, so that a merge changes the pushed weights
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    return model


def _gathered_units(engine):
    """(unit name, full elements) of every unit gathered now."""
    return lambda: [(u.name, sum(sp.layout.numel for sp in u.params)) for u in engine.unsharded_units()]


def _block_bound(model) -> int:
    """Elements of the largest decoder layer or of the largest parameter outside them: what one unit (or one
    decoder layer with its own sliced projections) holds at most."""
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.get_decoder().layers]
    return max(layers + [p.numel() for p in model.parameters()])


def sync_matches_unsharded(stage: int, lora: bool, linear_slice_numel: int | None = None) -> dict | None:
    """One step, then TRL's sync: rank 0 returns the pushed and the expected tensors, the metadata, the
    gathered units at each push and the one-block bound."""
    import zero_plugin as zp
    from zero_plugin.engines.engine import engine_of
    from zero_plugin.integrations import trl_vllm

    trl_vllm.install()  # what zero_plugin.run does once TRL's vllm_generation is imported
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    switch = {} if linear_slice_numel is None else {"linear_slice_numel": linear_slice_numel}
    model, optimizer = zp.setup(model, optimizer, zp.ZeroConfig(stage=stage, **switch))
    batch = models.shard_batch(models.make_batches("llama", 1, world, 2)[0], rank, world)
    models.loss_fn(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad()
    trained = zp.full_state_dict(model)
    watch = _gathered_units(engine_of(model, "test")) if stage == 3 else None
    client = RecordingClient(watch) if rank == 0 else None
    _generation(model, client).sync_weights()
    if rank != 0:
        return None
    reference = _model(lora)
    reference.load_state_dict(trained)
    expected = RecordingClient()
    _generation(reference, expected).sync_weights()
    return {
        "pushed": client.received,
        "metadata": client.metadata,
        "expected": expected.received,
        "expected_metadata": expected.metadata,
        "gathered": client.gathered,
        "bound": _block_bound(reference),
    }
