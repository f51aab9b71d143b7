# The two commands a fresh machine needs (see README): `make run` and `make test`.
.PHONY: setup run test test-unit test-heavy test-extended

PY := .venv/bin/python
# vLLM torch.compiles its sampler on first use (~20 s cold on CPU); eager gives identical outputs.
export TORCHDYNAMO_DISABLE ?= 1
# Heavy tests: multi-process (gloo), real vLLM engines and end-to-end runs. `make test` runs those not
# marked `extended` (heavy tests whose path another heavy test runs): budgeted to stay within ~35 minutes
# on a fast 2-core machine together with the unit tests (~75 on a slow one, where CI allows 90).
# `make test-extended` runs the extended ones.
HEAVY := (multiproc or vllm or e2e or slow) and not extended

setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m meshrl.trainer.main --config-name cpu_smollm2_grpo

test: setup
	$(PY) -m pytest -q --timeout=600
	$(PY) -m pytest -q --timeout=900 -m "$(HEAVY)"

test-unit: setup
	$(PY) -m pytest -q --timeout=600

test-heavy: setup
	$(PY) -m pytest -q --timeout=900 -m "$(HEAVY)"

test-extended: setup
	$(PY) -m pytest -q --timeout=900 -m extended
