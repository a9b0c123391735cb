# Pinned environment for this machine: torch 2.13.0 has a CPU wheel on disk.
# pyproject keeps a range so GPU users bring their own torch.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test lint demo bench fuzz clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH_PIN)
	$(VPY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# The lint runs first: a lint error fails `make test` (and so CI) before the suite starts.
test: lint
	$(VPY) -m pytest -q --durations=30 tests

# The long differential fuzz (tests/fuzz/README.md): FUZZ_EXAMPLES fresh specs from a fresh seed (printed,
# so a failure can be drawn again with `python -m tests.fuzz.explore --seed SEED`), every failure signature
# minimised; exit status 1 if any spec failed.  Run it after every change that touches numerics.
FUZZ_EXAMPLES ?= 1000
ifndef FUZZ_SEED
FUZZ_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
fuzz: $(STAMP)
	@echo "fuzz seed $(FUZZ_SEED), $(FUZZ_EXAMPLES) specs"
	$(VPY) -m tests.fuzz.explore --examples $(FUZZ_EXAMPLES) --seed $(FUZZ_SEED) --minimize --out fuzz-$(FUZZ_SEED).jsonl

# ruff's configuration is in pyproject.toml ([tool.ruff]).  Both checks always run and the target fails if
# either does; the format check names the files (`ruff format --diff` shows the changes).
lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache .; lint=$$?; $(VENV)/bin/ruff format --no-cache --check --output-format concise . || lint=1; \
	$(VENV)/bin/lint-imports --no-cache || lint=1; exit $$lint

# LoRA fine-tune of a small Llama-shaped model under ZeRO-3 on 2 CPU processes (examples/lora_finetune_accelerate.py):
# loss, tokens/s and memory per rank while it trains; answers before/after; memory and comm per rank; the
# adapter saved to out/demo/adapter and reloaded onto a fresh base model.  A few minutes on 2 CPU cores.
demo: $(STAMP)
	OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false $(VENV)/bin/zero-plugin launch --stage 3 --num_processes 2 \
		--num_machines 1 --mixed_precision no --dynamo_backend no --main_process_port 0 \
		examples/lora_finetune_accelerate.py --output_dir out/demo

# host_ops: the host work (ops, copies, hooks, CPU ms) zero_plugin adds per step against FSDP2 and DDP at 8
# fake ranks in one process (issue #39), a few minutes; writes benchmarks/results/host_ops.md.
# DeepSpeed must be built against the torch already installed (no build isolation, no CUDA ops),
# otherwise pip pulls a multi-GB CUDA torch into its build environment.
bench: $(STAMP)
	DS_BUILD_OPS=0 $(VPY) -m pip install -q --no-build-isolation deepspeed==0.19.8
	$(VPY) -m pip install -q -e '.[bench]'
	$(VPY) -m benchmarks.compare --size blocks34m --world-size 2
	$(VPY) -m benchmarks.compare --size small --world-size 2
	$(VPY) -m benchmarks.host_ops

clean:
	rm -rf $(VENV) build *.egg-info
