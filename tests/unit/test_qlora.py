"""QLoRA: a bitsandbytes 4-bit base (bf16 storage, the FSDP-QLoRA layout) with LoRA adapters under zp (issue 19,
item 9; [Note: packed 4-bit weights] in zero_plugin/loading/quantized.py).  bitsandbytes' CPU backend runs the 4-bit
matmuls, so the parity runs here: 2 gloo ranks against the unsharded single-process QLoRA run on the
concatenated batches (same seed, same data).  Tolerances: losses rtol 1e-5, LoRA weights 1e-5 of their update
(fp32 compute over a dequantized base: only the batch split's summation order differs).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests import qlora
from tests.harness import run_ranks
from tests.unit import qlora_workers as w

STEPS = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("qlora") / "base")
    qlora.save_base(folder)
    return folder


@pytest.fixture(scope="module")
def aligned_base(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("qlora") / "aligned")
    qlora.save_base(folder, aligned=True)
    return folder


def _reference(folder: str, steps: int, world: int) -> tuple[list[float], dict]:
    model = qlora.load_qlora(folder)
    initial = w.lora_weights(model.state_dict())
    opt = w.optimizer_for(model)
    losses = []
    for ids in w.global_batches(steps, world):
        loss = w.lm_loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, initial, w.lora_weights(model.state_dict())


def _relative_update_error(got: dict, want: dict, initial: dict) -> float:
    num = sum(float((got[k] - want[k]).double().norm() ** 2) for k in want) ** 0.5
    den = sum(float((want[k] - initial[k]).double().norm() ** 2) for k in want) ** 0.5
    assert den > 0, "the reference did not train"
    return num / den


# param_dtype="fp32" on a bf16-stored base: a cast of the packed codes (what stage 3 and stages 0-2 did to
# every frozen float parameter) would hand bitsandbytes 4-byte elements.
@pytest.mark.parametrize(
    "stage,config",
    [(3, {}), (3, {"param_dtype": "fp32", "offload_params": True}), (2, {"param_dtype": "fp32"})],
    ids=["stage3", "stage3-offload-fp32", "stage2-fp32"],
)
def test_qlora_matches_unsharded_single_process(base, stage, config, tmp_path):
    out = str(tmp_path) if not config else None
    results = run_ranks(2, w.train_worker, base, stage, STEPS, out, config, timeout=300)
    ref_losses, initial, ref_lora = _reference(base, STEPS, 2)
    for step, want in enumerate(ref_losses):
        got = sum(r["losses"][step] for r in results) / 2  # equal token counts: the mean of the halves
        assert got == pytest.approx(want, rel=1e-5), f"step {step}: loss {got} != unsharded {want}"
    for rank, r in enumerate(results):
        assert sorted(r["lora"]) == sorted(ref_lora), f"rank {rank}: LoRA keys differ"
        err = _relative_update_error(r["lora"], ref_lora, initial)
        assert err < 1e-5, f"rank {rank}: LoRA weights off by {err:.3g} of their update"
        # [Note: packed 4-bit weights]: gathered bytes are the loaded bytes, NaN-looking codes included
        assert r["nan_patterns"] > 0, "the test model has no NaN-looking packed codes; it cannot catch canonicalisation"
        assert r["bits_equal"], f"rank {rank}: the gathered packed weights differ from the loaded ones"
        assert any(k.endswith(".weight.quant_state.bitsandbytes__nf4") for k in r["quant_keys"]), r["quant_keys"]
        assert all(len(s) == 2 and s[1] == 1 for s in r["packed_shapes"].values()), r["packed_shapes"]
        if stage == 3:  # the packed base is sharded: half the bytes per rank (padding is not stored)
            assert r["shard_bytes"] == pytest.approx(r["full_bytes"] / 2, rel=0.01), (r["shard_bytes"], r["full_bytes"])
        else:
            assert r["shard_bytes"] == r["full_bytes"]
    if out is not None:
        _check_saved(base, out, ref_lora)
        resumed = run_ranks(2, w.resume_worker, base, out, timeout=300)
        for rank, r in enumerate(resumed):  # the checkpoint holds exactly what training left
            assert all(torch.equal(r["lora"][k], results[0]["lora"][k]) for k in ref_lora), f"rank {rank}: resumed LoRA"
            assert float(r["steps"][0]) == STEPS, r["steps"]


def _check_saved(base: str, out: str, ref_lora: dict) -> None:
    """The PEFT adapter save_pretrained wrote, and the sharded checkpoint consolidated both ways."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from zero_plugin.ckpt.consolidate import consolidate

    adapter = PeftModel.from_pretrained(qlora.load_base(base), os.path.join(out, "adapter"))
    err = max(float((adapter.state_dict()[k] - v).abs().max()) for k, v in ref_lora.items())
    assert err < 1e-5, f"save_pretrained adapter vs reference: {err:.3g}"
    consolidate(os.path.join(out, "ckpt"), os.path.join(out, "hf"), format="hf")
    saved = load_file(os.path.join(out, "hf", "adapter_model.safetensors"))
    assert len(saved) == len(ref_lora) and all("lora_" in k for k in saved), sorted(saved)
    consolidate(os.path.join(out, "ckpt"), os.path.join(out, "st"), format="safetensors", dtype=torch.float16)
    full = load_file(os.path.join(out, "st", "model.safetensors"))
    want = w.packed_bits(qlora.load_qlora(base))
    for key, bits in want.items():
        assert full[key].dtype == torch.bfloat16 and torch.equal(full[key].view(torch.int16), bits), key
        assert full[key + ".quant_state.bitsandbytes__nf4"].dtype == torch.uint8
        assert full[key + ".absmax"].dtype != torch.float16, "--dtype cast a quant state"
    lora_key = next(k for k in full if "lora_A" in k)
    assert full[lora_key].dtype == torch.float16, "--dtype must still cast the adapters"


def test_load_state_dict_of_a_full_qlora_state(base):
    results = run_ranks(2, w.load_state_dict_worker, base, timeout=300)
    for rank, r in enumerate(results):
        assert r["missing"] == r["unsharded_missing"] == [], (rank, r["missing"][:3])
        assert r["unexpected"] == r["unsharded_unexpected"], (rank, r["unexpected"][:3], r["unsharded_unexpected"][:3])
        assert all(".weight." in k for k in r["unexpected"]), r["unexpected"][:3]  # the quant-state entries only
        assert r["got"] == pytest.approx(r["want"], rel=1e-6), (rank, r)


def test_evaluation_only_4bit_base_forward_and_save_pretrained(aligned_base, tmp_path):
    """A 4-bit reference model (TRL DPO's path) at stage 3 in eval mode, where bitsandbytes would repack the
    gathered weight in place on this CPU: two forwards equal the unsharded model's, and save_pretrained's
    folder reloads as a pre-quantized checkpoint with the same outputs."""
    base = aligned_base
    out = str(tmp_path / "saved")
    results = run_ranks(2, w.evaluation_save_worker, base, out, timeout=300)
    want = qlora.load_base(base)(input_ids=w.global_batches(1, 1)[0]).logits
    for rank, r in enumerate(results):
        for i, logits in enumerate(r["logits"]):
            assert torch.allclose(logits, want, rtol=1e-5, atol=1e-6), (
                f"rank {rank}, forward {i}: sharded 4-bit forward differs"
            )
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"]["bnb_4bit_quant_storage"] == "bfloat16"
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out)  # a pre-quantized checkpoint: no quantization_config
    for module in reloaded.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    got = reloaded(input_ids=w.global_batches(1, 1)[0]).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (
        "save_pretrained of the sharded 4-bit model reloads differently"
    )


# -- unsupported schemes: ValueError at setup, before any collective ---------------------------------
def _setup_error(model) -> str:
    import zero_plugin as zp

    with pytest.raises(ValueError) as info:
        zp.setup(model, None, zp.ZeroConfig(stage=3))
    return str(info.value)


def test_4bit_with_integer_storage_is_refused(base):
    msg = _setup_error(qlora.load_base(base, bnb_4bit_quant_storage=torch.uint8))
    assert "torch.uint8" in msg and "bnb_4bit_quant_storage=torch.bfloat16" in msg, msg


def test_8bit_is_refused(base):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    assert any(type(p).__name__ == "Int8Params" for p in model.parameters())
    msg = _setup_error(model)
    assert "8-bit" in msg and "load_in_4bit=True" in msg, msg


@pytest.mark.parametrize("method", ["gptq", "awq", "hqq"])
def test_other_quantizers_are_refused(base, method):
    model = qlora.load_base(base)
    model.config.quantization_config = {"quant_method": method, "bits": 4}
    msg = _setup_error(model)
    assert repr(method) in msg and "load_in_4bit=True" in msg, msg


def test_trainable_4bit_weight_is_refused(base):
    model = qlora.load_base(base)
    weight = model.model.layers[0].self_attn.q_proj.weight
    weight.requires_grad_(True)
    assert "requires grad" in _setup_error(model)


def test_consolidate_hf_of_a_4bit_base_loads_with_from_pretrained(base, tmp_path):
    """``zero-plugin consolidate --format hf`` of a stage-3 checkpoint whose base is 4-bit: the folder is a
    pre-quantized transformers checkpoint (packed weights, quant-state entries, quantization_config)."""
    from transformers import AutoModelForCausalLM

    from zero_plugin.ckpt.consolidate import consolidate

    results = run_ranks(2, w.base_checkpoint_worker, base, str(tmp_path), timeout=300)
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "hf"), format="hf")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(reloaded.model.layers[0].mlp.down_proj.weight).__name__ == "Params4bit"
    for module in reloaded.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        got = reloaded(input_ids=w.global_batches(1, 2)[0]).logits
    for rank, r in enumerate(results):
        assert torch.allclose(got, r["logits"], rtol=1e-5, atol=1e-6), f"rank {rank}: consolidated 4-bit model differs"
    with torch.no_grad():
        untrained = qlora.load_base(base)(input_ids=w.global_batches(1, 2)[0]).logits
    assert not torch.allclose(got, untrained, rtol=1e-3), (
        "the step changed nothing: the check would not see lost updates"
    )
