"""QLoRA on CUDA (part ``qlora`` of tests/gpu/check.py): the CPU tests (tests/unit/test_qlora.py) run the same
checks on gloo; this one covers what only CUDA has: NCCL's buffered gathers of the packed bf16 codes, the
quant state moved to the compute device at setup, bitsandbytes' CUDA kernels.  NCCL world size 1, stage 3
(and stage 3 with parameter offload) against the same model trained without zp, bf16 compute as users run
QLoRA; the packed weights after training must be bitwise the loaded ones.  Never run yet (no GPU lent).

    python -m tests.gpu.qlora    # prints RESULT{json}
"""

from __future__ import annotations

import json
import os
import tempfile

import torch


def _load(folder: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_quant_storage=torch.bfloat16,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=quant, dtype=torch.bfloat16, device_map={"": 0}
    )
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def _bits(model) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    return {k: v.view(torch.int16).cpu() for k, v in sd.items() if k + ".quant_state.bitsandbytes__nf4" in sd}


def _train(folder: str, config: dict | None, steps: int = 3) -> dict:
    import zero_plugin as zp

    model = _load(folder)
    before = _bits(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if config is not None:
        model, opt = zp.setup(model, opt, zp.ZeroConfig(**config))
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 1024, (2, 64), generator=g).cuda()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    after = _bits(model)
    lora = {k: v.float().cpu() for k, v in model.state_dict().items() if "lora_" in k}
    return {"losses": losses, "lora": lora, "bits_equal": all(torch.equal(before[k], after[k]) for k in before)}


def part_qlora() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.gpu.check import _nccl_world1

    _nccl_world1()
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(1)
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=1024,
                hidden_size=256,
                intermediate_size=704,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=4,
            )
        ).save_pretrained(folder)
        ref = _train(folder, None)
        out = {"reference_losses": ref["losses"]}
        for name, cfg in {"stage3": dict(stage=3), "stage3_offload_params": dict(stage=3, offload_params=True)}.items():
            got = _train(folder, cfg)
            diff = max(float((got["lora"][k] - ref["lora"][k]).abs().max()) for k in ref["lora"])
            out[name] = {"losses": got["losses"], "lora_max_abs_diff": diff, "bits_equal": got["bits_equal"]}
    # world size 1: the same kernels on the same data, so equal up to bf16 rounding of the LoRA update
    out["ok"] = all(
        out[n]["bits_equal"]
        and out[n]["lora_max_abs_diff"] < 1e-2
        and max(abs(a - b) for a, b in zip(out[n]["losses"], ref["losses"])) < 1e-2
        for n in ("stage3", "stage3_offload_params")
    )
    return out


if __name__ == "__main__":
    os.environ.setdefault("MASTER_PORT", "29535")
    print("RESULT" + json.dumps(part_qlora(), default=str))
