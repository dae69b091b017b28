# Two commands do everything on a fresh machine:
#   make demo   the main job (builds .venv, then runs the embedded demo)
#   make test   every test (builds .venv and .venv-mmcv1 from scratch if needed, runs ruff and both suites)
SHELL := /bin/bash
.PHONY: demo test envs env-mmengine env-mmcv1 env-seed lint test-core test-mmengine test-mmengine-main \
	test-mmengine-numerics test-mmcv1 test-cuda \
	test-mmdet3d-scope test-seed-stack

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
	bash scripts/check_floor.sh

# tests/cuda runs on a GPU where there is one, else as a CPU rehearsal of its test code (tests/cuda/cuda_profile.py).
# Tests marked `numerics` run once more on torch's portable CPU kernels (ATEN_CPU_CAPABILITY=default): a machine with
# AVX-512 then also sees what a plain one computes (another accumulation order, another rounding).
NUMERICS_AGAIN = ATEN_CPU_CAPABILITY=default PETR_STABILITY_CUDA_REHEARSAL=1
test-mmengine: test-mmengine-main test-mmengine-numerics

test-mmengine-main: env-mmengine
	PETR_STABILITY_CUDA_REHEARSAL=1 .venv/bin/python -m pytest -q tests/core tests/contract tests/mmengine tests/cli \
	  tests/distributed/mmengine tests/distributed/torch_loop tests/cuda tests/zoo

test-mmengine-numerics: env-mmengine
	$(NUMERICS_AGAIN) .venv/bin/python -m pytest -q -m numerics tests/core tests/mmengine tests/cli tests/zoo

test-mmcv1: env-mmcv1
	PETR_STABILITY_CUDA_REHEARSAL=1 .venv-mmcv1/bin/python -m pytest -q tests/core tests/contract tests/mmcv1 tests/distributed/mmcv1 \
	  tests/cuda tests/cli/test_patch_config.py tests/cli/test_preflight.py tests/cli/test_cli.py tests/cli/test_packaging.py
	$(NUMERICS_AGAIN) .venv-mmcv1/bin/python -m pytest -q -m numerics tests/core tests/mmcv1

# The cuda group on this machine's GPU, in each environment (benchmarks/gpu_check.sh does it on a bare GPU machine).
test-cuda: envs
	.venv/bin/python -m pytest -q -rs -m cuda tests/cuda
	.venv-mmcv1/bin/python -m pytest -q -rs -m cuda tests/cuda

# The two suites run side by side, one thread each (2 cores; the models are small). The MMCV 1.x suite is the
# shorter, so the MMEngine suite's second pass under the default kernels runs after it, on its side (-k: it runs
# even when the MMCV 1.x suite failed); that side writes .test-side.log, printed at the end.
# tests/cli/test_packaging.py's `slow` tests build a fresh venv per family, each in its own suite (about 1 min of
# CPU each: pip, the pinned torch from local disk, the example); `-m "not slow"` leaves them out of a quick run.
test: envs lint
	@OMP_NUM_THREADS=1 $(MAKE) -k --no-print-directory test-mmcv1 test-mmengine-numerics > .test-side.log 2>&1 & \
	pid=$$!; OMP_NUM_THREADS=1 $(MAKE) --no-print-directory test-mmengine-main; rc=$$?; \
	wait $$pid; rc1=$$?; echo "---- .venv-mmcv1 suite, then the MMEngine numerics pass ----"; cat .test-side.log; \
	echo "make test: MMEngine suite exit $$rc, MMCV 1.x suite + MMEngine numerics exit $$rc1"; exit $$(( rc || rc1 ))

# Opt-in, not part of `make test`: mmcv with compiled ops (~17 min build), a Runner under default_scope='mmdet3d';
# with MMDET3D_ROOT=<mmdetection3d v1.4.0 clone> also its real projects/PETR in fp32 and under AMP (docs/seed-stack.md).
test-mmdet3d-scope:
	bash scripts/setup_full_mmcv.sh
	.venv-fullmmcv/bin/python -m pytest -q -rs tests_optin

# Opt-in, not part of `make test`: the seed document's own stack (mmcv-full 1.7.2 with CPU ops, mmdet 2.28.2,
# mmdet3d 1.0.0rc6; ~20 min to build) and the real StreamPETR / PETRv2 detectors from the user's clones
# (docs/seed-stack.md says how to get them):  make env-seed && STREAMPETR_ROOT=... PETR_ROOT=... make test-seed-stack
env-seed:
	bash scripts/setup_seed_stack.sh

test-seed-stack: env-seed
	.venv-seed/bin/python -m pytest -q -rs tests_seed
