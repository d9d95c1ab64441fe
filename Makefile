# The two commands of the README, plus the pieces they are made of.
# Every target that needs the environment runs scripts/setup.sh first: idempotent, seconds when
# nothing changed.
.PHONY: demo test setup lint bench clean gpu-smoke

demo: setup
	.venv/bin/agentrl demo

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest $(PYTEST_ARGS)

setup:
	scripts/setup.sh

lint: setup
	.venv/bin/ruff check .

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
