# The two commands a fresh clone needs:  make demo  and  make test.
.PHONY: setup demo test test-fast up lint bench

setup:
	@bash scripts/setup.sh

demo: setup
	@.venv/bin/carryover demo $(ARGS)

# two workers, each with its group of tests (tests/conftest.py says which and why)
test: setup
	@.venv/bin/python -m pytest -n 2 --dist loadgroup $(ARGS)

test-fast: setup
	@.venv/bin/python -m pytest -n 2 --dist loadgroup --fast $(ARGS)

up: setup
	@PATH="$(CURDIR)/.venv/bin:$$PATH" .venv/bin/honcho start

lint:
	@.venv/bin/ruff check .
	@.venv/bin/mypy

bench: setup
	@.venv/bin/python -m bench.gateway
	@.venv/bin/python -m bench.weight_sync
	@.venv/bin/python -m bench.async_vs_sync
	@.venv/bin/python -m bench.overhead
	@.venv/bin/python -m bench.scale
	@.venv/bin/python -m bench.drain_modes
