# Pinned environment for this machine: torch 2.13.0 has a CPU wheel on disk.
# pyproject keeps a range so GPU users bring their own torch.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH_PIN)
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q tests

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) -m torch.distributed.run --nproc-per-node 2 examples/quickstart.py --stage 3

# DeepSpeed must be built against the torch already installed (no build isolation, no CUDA ops),
# otherwise pip pulls a multi-GB CUDA torch into its build environment.
bench: $(STAMP)
	DS_BUILD_OPS=0 $(VPY) -m pip install -q --no-build-isolation deepspeed==0.19.8
	$(VPY) -m pip install -q -e '.[bench]'
	$(VPY) -m benchmarks.compare --size small --world-size 2

clean:
	rm -rf $(VENV) build *.egg-info
