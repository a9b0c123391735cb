"""``from_pretrained`` under stage 3 (``zero_plugin.run``): built on meta, filled by ``zp.setup`` unit by unit.

Each lazily loaded model is compared with transformers' eager load of the same checkpoint: the same
parameters after filling (float32 exact), the same buffers, ties and dtypes, the same LoRA adapters from
the same seed, and the same training losses at stage 3 (and at stage 2 with ``cpu_ram_efficient_loading``).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from tests import models
from tests.harness import run_ranks
from tests.unit import lazy_pretrained_workers as LW
from zero_plugin.config import ZeroConfig
from zero_plugin.integrations.accelerate import place_before_setup
from zero_plugin.loading import lazy_pretrained, materialize
from zero_plugin.run import _loads_lazily

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.* is deprecated:FutureWarning")


def _save(tmp_path, disk_dtype=torch.float32, sharded=False, safe=True, tie=True) -> str:
    model = models.make_tiny_llama(tie=tie, dtype=disk_dtype)
    if not safe:  # transformers 5 writes safetensors only; a pickle checkpoint as older versions wrote it
        model.config.save_pretrained(tmp_path)
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
        return str(tmp_path)
    model.save_pretrained(tmp_path, **({"max_shard_size": "20KB"} if sharded else {}))
    return str(tmp_path)


def _filled(model) -> None:
    """Fill a lazily loaded model's meta parameters from its recorded files, in this process."""

    class _Rank0:
        rank, backend, device = 0, "gloo", torch.device("cpu")

    materialize.materialize_all(model, materialize.recorded_source(model), _Rank0())


@pytest.mark.parametrize(
    "disk_dtype,dtype,sharded",
    [
        (torch.float32, torch.float32, False),
        (torch.bfloat16, torch.float32, True),  # bf16 on disk, fp32 in training, index + 3 files
        (torch.float32, torch.bfloat16, True),
    ],
)
@pytest.mark.parametrize("lora", [False, True])
def test_lazy_load_matches_eager(tmp_path, disk_dtype, dtype, sharded, lora):
    path = _save(tmp_path, disk_dtype, sharded)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    eager = LW.load(path, lazy=False, lora=lora, dtype=dtype)
    lazy = LW.load(path, lazy=True, lora=lora, dtype=dtype)
    meta = {n for n, p in lazy.named_parameters() if p.is_meta}
    assert meta == {n for n, _ in lazy.named_parameters() if "lora_" not in n}  # adapters are real
    inner = LW._inner(lazy)
    assert inner.lm_head.weight is inner.model.embed_tokens.weight
    for (n, b), (n2, b2) in zip(eager.named_buffers(), lazy.named_buffers(), strict=True):
        assert n == n2 and not b2.is_meta and torch.equal(b, b2), n  # rotary inv_freq computed as eagerly
    _filled(lazy)
    for (n, p), (n2, p2) in zip(eager.named_parameters(), lazy.named_parameters(), strict=True):
        assert n == n2 and p.dtype == p2.dtype and torch.equal(p, p2), n
        assert p.dtype == dtype or "lora_" in n  # PEFT keeps adapters of a bf16 base in fp32
    assert inner.lm_head.weight is inner.model.embed_tokens.weight


def test_pickle_checkpoint_falls_back_with_one_warning(tmp_path):
    path = _save(tmp_path, safe=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models_loaded = [LW.load(path, lazy=True, lora=False) for _ in range(2)]
    fallback = [str(w.message) for w in caught if issubclass(w.category, lazy_pretrained.LazyLoadFallbackWarning)]
    assert len(fallback) == 1, fallback
    assert "pickle" in fallback[0] and "N full copies in host RAM" in fallback[0]
    assert not any(p.is_meta for m in models_loaded for p in m.parameters())


def test_load_after_setup_is_eager_without_warning(tmp_path):
    path = _save(tmp_path)
    r = run_ranks(1, LW.load_after_setup_worker, path)[0]
    assert r == {"meta": 0, "warnings": 0}


@pytest.mark.parametrize("lora", [False, True])
def test_stage3_lazy_trains_like_eager(tmp_path, lora):
    path = _save(tmp_path, sharded=True)
    eager = run_ranks(2, LW.train_worker, path, 3, (), lora)
    lazy = run_ranks(2, LW.train_worker, path, 3, (0, 1), lora)
    for e, z in zip(eager, lazy):
        assert e["meta_before"] == 0 and z["meta_before"] > 0 and not z["any_meta"]
        assert z["tied"] and e["tied"]
        assert max(abs(a - b) for a, b in zip(e["losses"], z["losses"])) <= 1e-6, (e["losses"], z["losses"])
    for k, v in eager[0]["state"].items():
        assert torch.allclose(v, lazy[0]["state"][k], atol=1e-6, rtol=0), k


def test_stage2_cpu_ram_efficient_loading_trains_like_eager(tmp_path):
    """Rank 0 loads eagerly, rank 1 builds on meta (what zero_plugin.run does at stages 0-2 with the flag)."""
    path = _save(tmp_path)
    assert _loads_lazily(ZeroConfig(stage=2, cpu_ram_efficient_loading=True), rank=1)
    assert not _loads_lazily(ZeroConfig(stage=2, cpu_ram_efficient_loading=True), rank=0)
    assert not _loads_lazily(ZeroConfig(stage=2), rank=1) and _loads_lazily(ZeroConfig(stage=3), rank=0)
    eager = run_ranks(2, LW.train_worker, path, 2, (), True)
    mixed = run_ranks(2, LW.train_worker, path, 2, (1,), True, 3, True)
    assert mixed[0]["meta_before"] == 0 and mixed[1]["meta_before"] > 0
    for e, z in zip(eager, mixed):
        assert max(abs(a - b) for a, b in zip(e["losses"], z["losses"])) <= 1e-6, (e["losses"], z["losses"])
        assert z["tied"]
    for k, v in eager[0]["state"].items():
        assert torch.allclose(v, mixed[0]["state"][k], atol=1e-6, rtol=0), k


def test_cpu_ram_efficient_loading_from_env():
    env = {"ZERO_PLUGIN_STAGE": "1", "ZERO_PLUGIN_CPU_RAM_EFFICIENT_LOADING": "true"}
    assert ZeroConfig.from_env(env).cpu_ram_efficient_loading is True
    assert ZeroConfig().cpu_ram_efficient_loading is False
    with pytest.raises(ValueError, match="cpu_ram_efficient_loading"):
        ZeroConfig(cpu_ram_efficient_loading="yes")


@pytest.mark.parametrize("stage", [2, 3])
def test_placement_before_setup_moves_no_parameter_at_stage3(stage):
    """The meta device stands in for the accelerator: at stage 3 no parameter byte moves before setup (the
    engine moves one parameter at a time as it shards); buffers always move, and stages 0-2 move the model."""
    model = models.make_tiny_llama()
    place_before_setup(model, torch.device("meta"), stage)
    moved = sum(p.numel() for p in model.parameters() if p.is_meta)
    assert all(b.is_meta for b in model.buffers())
    assert moved == (0 if stage == 3 else sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_lazy_model_prepared_alone(tmp_path, stage):
    """A model prepared without an optimizer must not stay on meta: at stages 0-2 it is loaded in full (with a
    warning), at stage 3 it is sharded for evaluation from its files ([Note: evaluation-only models])."""
    import contextlib

    from accelerate.state import AcceleratorState

    import zero_plugin as zp
    from zero_plugin.integrations import common
    from zero_plugin.integrations.accelerate import Accelerator, ZeroPlugin

    path = _save(tmp_path)
    eager = LW.load(path, lazy=False, lora=False)
    frozen = LW.load(path, lazy=True, lora=False).requires_grad_(False)
    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(zero_plugin=ZeroPlugin(zp.ZeroConfig(stage=stage)))
        warns = (
            pytest.warns(UserWarning, match="prepared without an optimizer") if stage < 3 else contextlib.nullcontext()
        )
        with warns:
            prepared = accelerator.prepare(frozen)
        assert prepared is frozen and common.is_set_up(prepared) == (stage == 3)
        state = prepared.state_dict()  # full tensors at stage 3 too ([Note: stage-3 state dicts])
        ids = torch.arange(12).reshape(2, 6)
        with torch.no_grad():
            assert torch.equal(prepared(input_ids=ids).logits, eager(input_ids=ids).logits)
    finally:
        AcceleratorState._reset_state(True)
    for n, p in eager.state_dict().items():
        assert not state[n].is_meta and torch.equal(p, state[n]), n


# -- [Note: edits before setup] (zero_plugin/loading/lazy_edits.py); end to end in test_lazy_edits.py -----------
def _edited(path: str, lazy: bool, edit) -> torch.nn.Module:
    """Load (lazily or not) and apply ``edit`` while the lazy loading is installed, then fill from the files."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with LW.lazy_loading() if lazy else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        edit(model)
        if lazy:
            assert any(p.is_meta for p in model.parameters())
            _filled(model)
    return model


def _move_cast_switch(model) -> None:
    model.to("cpu").to(torch.bfloat16)
    model.float().eval().train()


def _resize(model) -> None:
    model.resize_token_embeddings(model.config.vocab_size + 5)


@pytest.mark.parametrize("edit", [_move_cast_switch, _resize])
@pytest.mark.parametrize("tie", [True, False])
def test_edits_before_setup_give_the_eager_values(tmp_path, edit, tie):
    path = _save(tmp_path, tie=tie)
    eager, lazy = _edited(path, False, edit), _edited(path, True, edit)
    for (n, p), (n2, p2) in zip(eager.named_parameters(), lazy.named_parameters(), strict=True):
        assert n == n2 and p.dtype == p2.dtype and torch.equal(p, p2), n
    assert (lazy.lm_head.weight is lazy.model.embed_tokens.weight) == tie


def test_resize_draws_as_eagerly(tmp_path):
    """The lazy resize consumes the global RNG as the eager one: the next draw is the same."""
    path = _save(tmp_path, tie=False)
    draws = []
    for lazy in (False, True):
        _edited(path, lazy, _resize)
        draws.append(torch.rand(4))
    assert torch.equal(*draws)


def test_forward_before_setup_names_the_switch(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _save(tmp_path)
    with LW.lazy_loading():
        model = AutoModelForCausalLM.from_pretrained(path)
        with pytest.raises(RuntimeError, match="loaded lazily.*ZERO_PLUGIN_LAZY_LOADING=false"):
            model(input_ids=torch.arange(4)[None])
        assert materialize.load_in_full(model)
        model(input_ids=torch.arange(4)[None])  # loaded in full: the refusal is gone with the record


def test_lazy_loading_switch():
    assert not _loads_lazily(ZeroConfig(stage=3, lazy_loading=False), rank=0)
    assert not _loads_lazily(ZeroConfig(stage=2, cpu_ram_efficient_loading=True, lazy_loading=False), rank=1)
    env = {"ZERO_PLUGIN_STAGE": "3", "ZERO_PLUGIN_LAZY_LOADING": "false"}
    assert ZeroConfig.from_env(env).lazy_loading is False and ZeroConfig().lazy_loading is True
