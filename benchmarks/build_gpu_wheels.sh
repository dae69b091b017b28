#!/usr/bin/env bash
# Builds/downloads the pure-Python wheels the GPU machine lacks (it has torch and numpy, no network) into
# wheelhouse/ (git-ignored; carried to the device). MMEngine's stack only: mmcv-lite and mmcv 1.x are both
# `mmcv` and cannot share one environment; the MMCV 1.x CUDA case runs in a second pass with its own wheelhouse.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
rm -rf wheelhouse && mkdir -p wheelhouse
"$py" -m pip download -q --no-deps -d wheelhouse --only-binary :all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  'mmengine==0.10.7' addict yapf platformdirs tomli termcolor rich markdown-it-py mdurl pygments pyyaml \
  opencv-python-headless
MMCV_WITH_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w wheelhouse 'mmcv-lite==2.1.0'
ls -la wheelhouse; du -sh wheelhouse
