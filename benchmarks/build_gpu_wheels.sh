#!/usr/bin/env bash
# Builds the pure-Python wheels the GPU machine lacks (it has Python 3.12, torch, torchvision, numpy, opencv,
# pyyaml, rich, matplotlib and pytest, and no network) into wheelhouse/ (git-ignored; carried to the device):
#   wheelhouse/common    addict, yapf, platformdirs, termcolor (the project's own wheel is built there, from the
#                        tree that travels, by gpu_check.sh: it is never stale)
#   wheelhouse/mmengine  mmengine 0.10.7 + mmcv-lite 2.1.0
#   wheelhouse/mmcv1     mmcv 1.7.2
# mmcv-lite and mmcv 1.x are both `mmcv`: gpu_check.sh installs each stack into its own --target folder.
# Then checks that every wheel's requirements (and the project's) are met by the wheelhouse or by the GPU image's package list
# (GPU_PACKAGES, one name per line; benchmarks/gpu_image_packages.txt by default).
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's two environments have setuptools<81 and wheel, which the project's and MMCV's setup.py need.
py=${PYTHON:-.venv/bin/python}
mmcv1_py=${MMCV1_PYTHON:-.venv-mmcv1/bin/python}
[ -x "$py" ] || bash scripts/setup_envs.sh mmengine
[ -x "$mmcv1_py" ] || bash scripts/setup_envs.sh mmcv1
rm -rf wheelhouse && mkdir -p wheelhouse/common wheelhouse/mmengine wheelhouse/mmcv1
dl() { "$py" -m pip download -q --no-deps -d "$1" --only-binary :all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 "${@:2}"; }
dl wheelhouse/common addict 'yapf==0.43.0' platformdirs termcolor
dl wheelhouse/mmengine 'mmengine==0.10.7'
MMCV_WITH_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w wheelhouse/mmengine 'mmcv-lite==2.1.0'
MMCV_WITH_OPS=0 "$mmcv1_py" -m pip wheel -q --no-deps --no-build-isolation -w wheelhouse/mmcv1 'mmcv==1.7.2'
rm -rf build  # setuptools would reuse a stale build/lib
"$py" -m pip wheel -q --no-deps --no-build-isolation -w wheelhouse/common .  # for the check only
rm -rf build
"$py" benchmarks/check_wheelhouse.py wheelhouse "${GPU_PACKAGES:-benchmarks/gpu_image_packages.txt}"
rm wheelhouse/common/petr_stability-*.whl
du -sh wheelhouse
