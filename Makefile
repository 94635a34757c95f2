# dash_fa3 developer targets. See README.md.
PYTHON ?= python3
export CUDA_HOME ?= /usr/local/cuda

.PHONY: install dev test test-cpu ptxas gpu-check cp-check bench clean

install:  ## build and install (DASH_FA3_VARIANTS narrows the variants)
	$(PYTHON) -m pip install --no-build-isolation -v -e ".[test]"

dev:  ## in-place build of one variant for kernel iteration
	DASH_FA3_VARIANTS=$${DASH_FA3_VARIANTS:-hdim128-bf16} $(PYTHON) setup.py build_ext --inplace

test:  ## the README's test command: CPU tests run, GPU tests skip without a Hopper GPU
	$(PYTHON) -m pytest tests -q -rs

ptxas:  ## per-kernel registers / spills / shared memory for the selected variants, no GPU needed
	$(PYTHON) tools/ptxas_report.py

gpu-check:  ## on the Hopper machine: build (or use a carried build), GPU tests, main job; logs in $$OUT
	bash tools/gpu_check.sh

cp-check:  ## on a machine of 2+ GPUs: distributed GPU tests and bench_distributed (CP_NPROC, CP_BENCH_ARGS); logs in $$OUT
	bash tools/cp_gpu_check.sh

bench:  ## the main job
	$(PYTHON) -m dash_fa3.bench

clean:
	rm -rf build dash_fa3/_C*.so *.egg-info
