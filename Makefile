# The two commands of the README, plus the pieces they are made of.
# Every target that needs the environment runs scripts/setup.sh first: idempotent, seconds when
# nothing changed.
.PHONY: demo test setup lint bench clean

demo: setup
	.venv/bin/agentrl demo

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest $(PYTEST_ARGS)

setup:
	scripts/setup.sh

lint: setup
	.venv/bin/ruff check .

clean:
	rm -rf .venv build dist *.egg-info runs
