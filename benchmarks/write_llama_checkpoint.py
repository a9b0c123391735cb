"""Write a Llama-shaped causal LM as a sharded fp32 safetensors checkpoint, one block at a time.

    python -m benchmarks.write_llama_checkpoint /data/llama-3b            # ~3.0B parameters, ~12 GB
    python -m benchmarks.write_llama_checkpoint /tmp/tiny --layers 2 --hidden 64 --intermediate 128 --vocab 512

The default shape is Llama-3.2-3B's (hidden 3072, 28 layers, MLP 8192, 24 heads, 8 KV heads, untied
output layer) with a 32000 vocabulary: 3,015,355,392 parameters, 12.06 GB in fp32.  The folder is what
``from_pretrained`` reads: ``config.json``, ``model-0000i-of-0000n.safetensors`` (the embedding, one file
per decoder layer, then the final norm and the output layer), ``model.safetensors.index.json``, and the
examples' default byte-level BPE tokenizer (``examples/common.py``: trained on the examples' data, no
download), so ``examples/finetune_trainer.py --model FOLDER`` runs offline.

The writer never builds the model: names and shapes come from the model built on the meta device, and
each tensor is drawn from its own seeded generator (normal(0, initializer_range) for matrices, ones for
norms), so a file's contents do not depend on how tensors are grouped into files.  Its peak RSS grows by
about one file (measured at the default width: 384 MiB, the largest file, over 1.19 GB written; the
whole process peaked at 0.74 GB); the last JSON line it prints says how much it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def llama_config(
    *,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    eos_token_id: int | None,
    pad_token_id: int | None,
):
    from transformers import LlamaConfig

    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError(
            f"--hidden {hidden} / --heads {heads} / --kv_heads {kv_heads}: heads must divide hidden "
            "into an even head size, and kv_heads must divide heads"
        )
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
    )


def tensor_layout(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor ``save_pretrained`` would write, in module order (built on meta)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def group_into_files(layout: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[int, str, tuple[int, ...]]]]:
    """(index in layout, name, shape) per file: what precedes the layers, one file per layer, what follows."""
    groups: dict[str, list] = {}
    for index, (name, shape) in enumerate(layout):
        m = _LAYER.match(name)
        key = f"layer{int(m.group(1)):06d}" if m else ("head" if any(k.startswith("layer") for k in groups) else "0")
        groups.setdefault(key, []).append((index, name, shape))
    return [groups[k] for k in sorted(groups, key=lambda k: (k == "head", k))]


def make_tensor(index: int, name: str, shape: tuple[int, ...], *, seed: int, std: float) -> torch.Tensor:
    """Tensor ``index`` of the layout: its own generator, so it does not depend on the file grouping."""
    if len(shape) == 1:  # RMSNorm weights
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def write_checkpoint(out: Path, config, files: list[list], *, seed: int = 0) -> dict:
    """Write ``files`` (``group_into_files``) and the index and config into ``out``; returns what was written."""
    from safetensors.torch import save_file

    weight_map, total, largest = {}, 0, 0
    for number, group in enumerate(files, 1):
        filename = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        tensors = {
            name: make_tensor(i, name, shape, seed=seed, std=config.initializer_range) for i, name, shape in group
        }
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total, largest = total + size, max(largest, size)
        weight_map.update({name: filename for name in tensors})
        del tensors
        print(f"  {filename}: {size / 2**20:,.0f} MiB", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config.save_pretrained(str(out))
    return {"files": len(files), "bytes": total, "largest_file_bytes": largest, "params": total // 4}


def default_tokenizer():
    """The examples' default BPE (trained on their data, cached), as ``examples/finetune_trainer.py`` makes it."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import common  # examples/common.py

    return common.default_tokenizer(common.DEFAULT_DATA, common.DEFAULT_CACHE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder to create (must not exist, or be empty)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000, help="at least the tokenizer's 512 tokens")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.measure import RssPeak

    args = parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"write_llama_checkpoint: {args.out} is not empty; give a new folder")
    tokenizer = default_tokenizer()
    if args.vocab < len(tokenizer):
        raise SystemExit(
            f"write_llama_checkpoint: --vocab {args.vocab} is smaller than the tokenizer's {len(tokenizer)} tokens"
        )
    config = llama_config(
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(args.out))
    files = group_into_files(tensor_layout(config))  # before the meter: imports and the meta model
    meter, started = RssPeak(), time.perf_counter()
    meter.start()
    summary = write_checkpoint(args.out, config, files, seed=args.seed)
    summary.update(
        peak_rss_increase=meter.stop(),
        seconds=round(time.perf_counter() - started, 1),
        rss_method=RssPeak.method,
        out=os.fspath(args.out),
    )
    print(
        f"wrote {summary['params']:,} parameters ({summary['bytes'] / 1e9:.2f} GB) in {summary['files']} files, "
        f"{summary['seconds']} s; writer's peak RSS increase {summary['peak_rss_increase'] / 2**20:,.0f} MiB"
    )
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
