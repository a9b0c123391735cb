#!/usr/bin/env bash
# One call on a lent GPU machine: installs the package into the machine's Python (torch is already
# there), runs the CUDA checks, and writes $OUT/gpu_results.json (see tests/gpu/check.py).  The parts run
# in order (parity, overlap, offload, fake_pg_memory, lazy_load, qlora, lora_13b, speed_vs_fsdp2); pass e.g. `--parts parity overlap`
# to run some.  "overlap" (tests/gpu/overlap.py) checks the stage-3 side streams: prefetch overlapping
# compute, identical per-step peak memory; tests/gpu/test_overlap.py is its pytest form.  "lazy_load"
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
