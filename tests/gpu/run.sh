#!/usr/bin/env bash
# One call on a lent GPU machine: installs the package into the machine's Python (torch is already
# there), runs the CUDA checks, and writes $OUT/gpu_results.json (see tests/gpu/check.py); exits 1 when a part
# raised or reported ok: false.  The parts run in order (parity, overlap, offload, colocate, activation_offload, fake_pg_memory, lazy_load,
# qlora, lora_13b, speed_vs_fsdp2); pass e.g. `--parts overlap speed_vs_fsdp2` to run some (the parts issue
# #39 fixed, first on the next machine).  "overlap" (tests/gpu/overlap.py) measures how much of a stand-in wire
# time before every stage-3 collective a host-bound model's step exposes, forward and backward, against a
# control whose host stalls after each collective, and the per-step peak memory; tests/gpu/test_overlap.py is
# its pytest form.  "speed_vs_fsdp2" (tests/gpu/speed.py) times stage 3 against FSDP2 at 8 ranks under the fake
# process group on the one GPU (the main figure; at world size 1 FSDP2 issues no collective) and over NCCL at
# world size 1, after checking both train.  "lazy_load"
# (tests/gpu/lazy_load.py) prepares a 1.1 GB model at stage 3 under a 512 MiB set_per_process_memory_fraction cap.  "qlora"
# (tests/gpu/qlora.py) needs bitsandbytes on the machine (pip install -e '.[qlora]').
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-.}"
# --no-build-isolation: the machine reaches no package index, so pip cannot fetch setuptools into an isolated
# build environment (the run of 2026-12-04 fell back to PYTHONPATH, where zero_plugin.integrations, mapped
# from ./integrations by pyproject's package-dir, does not exist).
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
python3 -c "import zero_plugin.integrations.hf_trainer" || { echo "zero_plugin.integrations is not importable"; exit 1; }
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
timeout 470 python3 -m tests.gpu.check --out "$OUT/gpu_results.json" "$@"
