# Every target sets itself up: a fresh machine needs only python3 and make.
PY      := .venv/bin/python
STAMP   := .venv/.installed
FP8LAB  := .venv/bin/fp8lab
# demo-long has no time budget: it adds te-current to the default recipes
LONG_RECIPES := fp32,bf16,te-delayed,te-current,deepseek-v3,mxfp8,hif8-delayed,e4m3-unscaled-grads

.PHONY: demo demo-long demo-debug test test-slow test-avx2 test-torch-kernels readme-tables lint format docs bench clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	# torch first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	# pyproject.toml has lower bounds only; the exact versions come from constraints.txt.
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(FP8LAB) compare --jobs 2 --threads 1 --noise-seeds 1 --out runs/demo
	$(PY) scripts/check_report.py runs/demo/report.html

demo-long: $(STAMP)
	$(FP8LAB) compare --jobs 2 --threads 1 --noise-seeds 1 --steps 1000 --recipes $(LONG_RECIPES) --set train.eval_every=50 --set train.checkpoint_every=100 --out runs/demo-long
	$(PY) scripts/check_report.py runs/demo-long/report.html

# fp8lab debug on a planted fault (a gradient spike poisons te-delayed's gradient scales): the verdict
# names role grad_output and the layers, runs/demo-debug/fix.toml is the tested fix
demo-debug: $(STAMP)
	$(FP8LAB) debug --scenario gradient-spike --jobs 2 --threads 1 --out runs/demo-debug
	$(PY) scripts/check_report.py runs/demo-debug/report.html

# pytest on JOBS worker processes (pytest-xdist; JOBS=2: the CI machine's two cores; JOBS=1 is
# one worker), an idle worker taking tests queued for a busy one; the slowest 15 listed at the end
JOBS ?= 2
PYTEST := $(PY) -m pytest -n $(JOBS) --dist worksteal --durations=15

# The fast suite (every test not marked slow) on the default kernels (numba on the CPU), then the
# numeric subset again on the device-generic torch kernels (test-torch-kernels, below): the oracle
# suite on both backends. <= 10 min on a quiet 2-core machine.
test: $(STAMP)
	$(PYTEST) -m "not slow"
	FP8LAB_KERNELS=torch $(PYTEST) $(REPEAT) $(NUMERIC_TESTS)

# The tests marked slow: end-to-end debugger runs, multi-process torch.distributed runs, the
# studies' smallest stages, the gpu_check smoke run, the probes on a local 2-CPU Ray instance (the
# `ray` extra, installed here on first use: a large install make test does without). CI runs it
# after make test.
RAY_STAMP := .venv/.installed-ray
$(RAY_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[ray]'
	touch $(RAY_STAMP)

test-slow: $(RAY_STAMP)
	$(PYTEST) -m slow

# The numeric subset (formats, scaling, qtensor, gemm, recipe fingerprints, optim, nn, observe,
# stats; the bit-for-bit tests of fp8lab's own arithmetic) again under AVX2 kernels, as on a CPU
# without AVX-512: torch's ATen kernels, MKL and oneDNN limited to AVX2, numba compiling for
# Haswell (AVX2 + FMA; NUMBA_CPU_FEATURES empty = that CPU's own features, not the host's). About
# 2 min on 2 cores. On an AVX2-only host it repeats make test's run of these files.
NUMERIC_TESTS := tests/formats tests/scaling tests/qtensor tests/gemm tests/recipe tests/optim \
	tests/nn tests/observe tests/test_stats.py
# The repeats (test-torch-kernels, test-avx2) leave out the tests marked no_arithmetic (imports,
# an exact all-reduce: nothing the kernel choice or the instruction set could change), which make
# test's first pass runs, and the slow ones, which make test-slow runs (tests/test_make_passes.py).
# tests/test_layers.py is not repeated.
REPEAT := -m "not no_arithmetic and not slow"
# Its own inductor cache: torch 2.13's on-disk cache does not key on ATEN_CPU_CAPABILITY, so an
# AVX2 run would load kernels generated for AVX-512 (wrong bits) and leave AVX2 ones that a
# later AVX-512 run loads (16-lane stores into 8-lane buffers: heap corruption, measured).
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
	NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES= TORCHINDUCTOR_CACHE_DIR=/tmp/fp8lab-inductor-avx2

test-avx2: $(STAMP)
	$(AVX2_ENV) $(PY) -c "import torch; c = torch.backends.cpu.get_cpu_capability(); \
		print('torch CPU capability:', c); assert c in ('AVX2', 'DEFAULT'), c"
	$(AVX2_ENV) $(PYTEST) $(REPEAT) $(NUMERIC_TESTS)

# The numeric subset again on the device-generic torch kernels (FP8LAB_KERNELS=torch): the same
# bits as numba. tests/conftest.py makes every numba kernel raise in this run, so a result that
# still came from numba fails; tests of numba kernels themselves are marked numba_only and skipped.
test-torch-kernels: $(STAMP)
	FP8LAB_KERNELS=torch $(PYTEST) $(REPEAT) $(NUMERIC_TESTS)

# The README's (and docs') result tables from runs/demo and runs/demo-long (make demo /
# make demo-long first), each with the machine and date it came from
readme-tables: $(STAMP)
	$(PY) scripts/readme_tables.py runs/demo runs/demo-long

# ruff check + format check: the same hooks as .pre-commit-config.yaml
lint: $(STAMP)
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

# The documentation site (mkdocs.yml, docs/) into site/, strict: a warning (broken link, page missing
# from the nav, unresolved API reference) fails the build. The `docs` extra installs on first use.
DOCS_STAMP := .venv/.installed-docs
$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet

format: $(STAMP)
	.venv/bin/ruff format . && .venv/bin/ruff check --fix .

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf .venv build site src/*.egg-info .pytest_cache
