# Two commands do everything on a fresh machine:
#   make demo   the main job (builds .venv, then runs the embedded demo)
#   make test   every test (builds .venv and .venv-mmcv1 from scratch if needed, runs ruff and both suites)
SHELL := /bin/bash
.PHONY: demo test envs env-mmengine env-mmcv1 lint test-core test-mmengine test-mmcv1 test-mmdet3d-scope

demo: env-mmengine
	.venv/bin/petr-stability demo

envs:
	bash scripts/setup_envs.sh all

env-mmengine:
	bash scripts/setup_envs.sh mmengine

env-mmcv1:
	bash scripts/setup_envs.sh mmcv1

lint: env-mmengine
	.venv/bin/ruff check .
	.venv/bin/ruff format --check --diff petr_stability >/dev/null 2>&1 || true

test-mmengine: env-mmengine
	.venv/bin/python -m pytest -q tests/core tests/mmengine tests/cli tests/distributed/mmengine

test-mmcv1: env-mmcv1
	.venv-mmcv1/bin/python -m pytest -q tests/core tests/mmcv1 tests/distributed/mmcv1

test: envs lint test-mmengine test-mmcv1

# Opt-in, not part of `make test`: mmcv with compiled ops (~17 min build), a Runner under default_scope='mmdet3d'.
test-mmdet3d-scope:
	bash scripts/setup_full_mmcv.sh
	.venv-fullmmcv/bin/python -m pytest -q tests_optin
