"""Peak host memory of one forward + backward of the LM head and its cross-entropy, untiled
(``F.cross_entropy(lm_head(hidden).float(), labels)``) against ``zp.tiled_lm_loss`` (docs/long-context.md).

    python -m benchmarks.tiled_loss_memory                        # T 4096, vocab 32000, hidden 1024, float32
    python -m benchmarks.tiled_loss_memory --tokens 8192 --hidden 2048 --tile-tokens 512

Each variant runs in a fresh subprocess (no heap its predecessor grew) and reports its peak RSS increase over
the forward and backward, above the inputs, the head and its gradient buffer already allocated
(``benchmarks.measure.RssPeak``: VmHWM reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import zero_plugin as zp
from benchmarks.measure import RssPeak, release_memory

MIB = 1 << 20


def measure(variant: str, tokens: int, vocab: int, hidden: int, tile_tokens: int) -> dict:
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    head.weight.grad = torch.zeros_like(head.weight)  # both variants accumulate into it: not part of the peak
    states = torch.randn(1, tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    release_memory()
    peak = RssPeak()
    peak.start()
    start = time.perf_counter()
    if variant == "tiled":
        loss = zp.tiled_lm_loss(states, head, labels, tile_tokens=tile_tokens)
    else:
        loss = F.cross_entropy(head(states).float().flatten(0, 1), labels.flatten())
    loss.backward()
    seconds = time.perf_counter() - start
    return {"variant": variant, "peak_mib": peak.stop() / MIB, "seconds": seconds, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tile-tokens", type=int, default=1024)
    parser.add_argument("--variant", choices=["untiled", "tiled"], help="run one variant here (the subprocess)")
    args = parser.parse_args()
    shape = (args.tokens, args.vocab, args.hidden, args.tile_tokens)
    if args.variant:
        print(json.dumps(measure(args.variant, *shape)))
        return
    logits_mib = args.tokens * args.vocab * 4 / MIB
    print(
        f"T {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, tile {args.tile_tokens} tokens, float32 "
        f"(one [T, vocab] float32 logits: {logits_mib:.0f} MiB); peak RSS increase over forward + backward:"
    )
    results = {}
    for variant in ("untiled", "tiled"):
        argv = [sys.executable, "-m", "benchmarks.tiled_loss_memory", "--variant", variant]
        argv += [f"--{k}={v}" for k, v in zip(("tokens", "vocab", "hidden", "tile-tokens"), shape)]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        r = results[variant]
        print(f"  {variant:8s} {r['peak_mib']:8.0f} MiB  {r['seconds']:6.2f} s  loss {r['loss']:.6f}")
    saved = results["untiled"]["peak_mib"] - results["tiled"]["peak_mib"]
    print(f"  saved    {saved:8.0f} MiB ({results['untiled']['peak_mib'] / results['tiled']['peak_mib']:.1f}x less)")


if __name__ == "__main__":
    main()
