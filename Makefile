# The two commands of the README, plus the pieces they are made of.
# Every target that needs the environment runs scripts/setup.sh first: idempotent, seconds when
# nothing changed.
.PHONY: demo test check setup lint bench clean gpu-smoke

demo: setup
	.venv/bin/agentrl demo

# The whole suite in two halves: the quick lane (below) on two workers, then the tests it leaves
# out (`--heavy`: Docker, vLLM, Ray, GPU, slow), also on two workers, a test file per worker at a time
# (`--dist loadfile`: a module's engines and sandboxes start once, in one worker); much of a heavy
# test is waiting (process start-up, containers, a peer rank), so two workers overlap it. Files go
# longest first, by the seconds tests/heavy_durations.json records (tests/conftest.py; xdist's own
# order, most tests first, would leave a long file of few tests to the end). It ends with its 25
# slowest tests, where the suite's time goes, and writes every file's seconds to
# build/heavy-durations.json.
HEAVY_WORKERS ?= 2
test: setup
	$(LINT)
	$(QUICK_LANE)
	.venv/bin/python -m pytest --heavy -n $(HEAVY_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# Lint: ruff, then mypy over the public API (scripts/typecheck.py: `[tool.mypy]` in pyproject.toml says
# which modules; seconds with its cache in build/, about 20 s of CPU without).
LINT = .venv/bin/ruff check . && .venv/bin/python scripts/typecheck.py

# The quick lane, a subset of `make test`: lint and the tests that need no Docker engine, no vLLM and
# no Ray (nor a GPU, nor minutes each), in 2-3 minutes. `--quick` (tests/conftest.py) deselects
# the tests marked docker, vllm, ray, gpu or slow and hides Docker and vLLM from the rest, so a test
# that needs them without its marker fails here instead of slowing the lane down. Two pytest workers
# (pytest-xdist) with one OpenMP thread each: the lane's torch tests use tiny models, and on a loaded
# box two threads each ran them 2-5x slower (docs/DEVELOPING.md).
CHECK_WORKERS ?= 2
QUICK_LANE = OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest --quick -q -n $(CHECK_WORKERS) $(PYTEST_ARGS)
check:
	AGENTRL_SKIP_DOCKER=1 scripts/setup.sh
	$(LINT)
	$(QUICK_LANE)

setup:
	scripts/setup.sh

lint: setup
	$(LINT)

# A short pass of the CPU benchmarks (a few minutes), one JSON each in runs/bench/; the full runs and
# the measured numbers: benchmarks/RESULTS.md.
BENCH_OUT ?= runs/bench
bench: setup
	mkdir -p $(BENCH_OUT)
	.venv/bin/python benchmarks/sandbox.py --quick --backends docker,bwrap,local > $(BENCH_OUT)/sandbox.json
	.venv/bin/python benchmarks/env_step.py --envs 1,2 --episodes 4 > $(BENCH_OUT)/env_step.json
	.venv/bin/python benchmarks/rollout.py --tasks 2 --group-size 2 --max-turns 3 --repeats 1 > $(BENCH_OUT)/rollout.json
	CUDA_VISIBLE_DEVICES= .venv/bin/python benchmarks/train_gpu.py --tiny --steps 2 > $(BENCH_OUT)/train_gpu.json
	CUDA_VISIBLE_DEVICES= .venv/bin/python benchmarks/lora.py --tiny --steps 2 > $(BENCH_OUT)/lora.json
	@echo "bench: results in $(BENCH_OUT)/"

# The first command on a GPU machine: the gpu tests, benchmarks/train_gpu.py and a short `agentrl train`
# with a colocated engine, one JSON in $OUT (or here). Without network, run ../shared/gpu/carry.sh before
# and send .gpu/ along (../shared/gpu/README.md); with a project venv, that venv is used.
gpu-smoke:
	@if [ -f .gpu/install.sh ]; then \
		bash .gpu/install.sh && PYTHONPATH=/tmp/site python3 -P benchmarks/gpu_smoke.py --out "$${OUT:-.}/gpu_smoke.json"; \
	else \
		.venv/bin/python benchmarks/gpu_smoke.py --out "$${OUT:-.}/gpu_smoke.json"; \
	fi

clean:
	rm -rf .venv build dist *.egg-info runs
