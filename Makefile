# Every target sets itself up: a fresh machine needs only python3 and make.
PY      := .venv/bin/python
STAMP   := .venv/.installed
FP8LAB  := .venv/bin/fp8lab
# demo-long has no time budget: it adds te-current to the default recipes
LONG_RECIPES := fp32,bf16,te-delayed,te-current,deepseek-v3,mxfp8,hif8-delayed,e4m3-unscaled-grads

.PHONY: demo demo-long demo-debug test lint format bench clean

$(STAMP): pyproject.toml
	python3 -m venv .venv
	# torch first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(FP8LAB) compare --jobs 2 --threads 1 --out runs/demo
	$(PY) scripts/check_report.py runs/demo/report.html

demo-long: $(STAMP)
	$(FP8LAB) compare --jobs 2 --threads 1 --steps 1000 --recipes $(LONG_RECIPES) --set train.eval_every=50 --set train.checkpoint_every=100 --out runs/demo-long
	$(PY) scripts/check_report.py runs/demo-long/report.html

# fp8lab debug on a planted fault (a gradient spike poisons te-delayed's gradient scales): the verdict
# names role grad_output and the layers, runs/demo-debug/fix.toml is the tested fix
demo-debug: $(STAMP)
	$(FP8LAB) debug --scenario gradient-spike --jobs 2 --threads 1 --out runs/demo-debug
	$(PY) scripts/check_report.py runs/demo-debug/report.html

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

format: $(STAMP)
	.venv/bin/ruff format . && .venv/bin/ruff check --fix .

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf .venv build src/*.egg-info .pytest_cache
