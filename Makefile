# The two commands a fresh machine needs (see README): `make run` and `make test`.
.PHONY: setup run lint test test-unit test-heavy test-extended

PY := .venv/bin/python
# torch.compile off: the policy's and reference's compiled regions (use_torch_compile, on by verl's default) are an
# inductor C++ build per process on CPU; eager runs the same formulas (tests/parallel/test_compiled.py).
export TORCHDYNAMO_DISABLE ?= 1
# Heavy tests: multi-process (gloo), real vLLM engines and end-to-end runs. `make test` runs those not
# marked `extended` (heavy tests whose path another heavy test runs); `make test-extended` runs the extended
# ones. Budget: `make test` within 30 minutes on CI's slow 2-core machines; measured 31:31 (35:19 with set-up) on a
# fresh clone on a 2-core Intel Xeon VM (2026-11-29 evening; 29:41 and 26:37 earlier that day; CI's last landing took 34:54)
# (tests/durations.md: seconds per file; tests/README.md maps each capability to its test).
HEAVY := (multiproc or vllm or e2e or slow) and not extended
# Two pytest worker processes (pytest-xdist), each test file on one of them: an end-to-end run keeps about one
# core busy (its driver waits while its worker computes), so two files at a time fill a 2-core machine.
# JOBS=0 runs in one process.
JOBS ?= 2
XDIST := $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m meshrl.trainer.main --config-name cpu_smollm2_grpo

# ruff's pyflakes and pycodestyle rules (pyproject.toml), a second or two: part of `make test`.
lint: setup
	.venv/bin/ruff check meshrl tests bench scripts launch

test: setup lint
	$(PY) -m pytest -q --timeout=600 $(XDIST)
	$(PY) -m pytest -q --timeout=900 $(XDIST) -m "$(HEAVY)"

test-unit: setup
	$(PY) -m pytest -q --timeout=600 $(XDIST)

test-heavy: setup
	$(PY) -m pytest -q --timeout=900 $(XDIST) -m "$(HEAVY)"

test-extended: setup
	$(PY) -m pytest -q --timeout=900 $(XDIST) -m extended
