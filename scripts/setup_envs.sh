#!/usr/bin/env bash
# Builds the test environments from scratch (idempotent: a finished env is kept, stamped by this file's hash).
#   .venv        MMEngine 0.10.7 + mmcv-lite 2.1.0 + mmdet 3.3.0 / mmdet3d 1.4.0 (--no-deps) on torch 2.13.0 (CPU)
#   .venv-mmcv1  MMCV 1.7.2 (pure Python) on torch 2.14.1 + torchvision 0.29.1, plus mmengine 0.10.7 beside it
#                (many PETR environments have both; the hooks must register with MMCV 1.x's registry there too)
# Both have tensorboard: the scalar tests read TensorBoard event files back.
# The pinned torch is installed first, on its own: pip takes it from this machine's local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
which_envs=${1:-all}
# Bump ENV_VERSION when the pinned stacks below change: a finished env is rebuilt only then (or when setup.py does).
ENV_VERSION=3
stamp_of() { { echo "$ENV_VERSION"; cat setup.py; } | sha1sum | cut -c1-12; }
# pip's config here lists local indexes that lack most projects; its "is ignored" notes are noise, not errors.
pip_in() { local env=$1; shift; "$env/bin/pip" install -q "$@" 2> >(grep -v 'is ignored: it is neither' >&2); }

build_mmengine() {
  local env=.venv
  if [ -f "$env/.stamp" ] && [ "$(cat "$env/.stamp")" = "$(stamp_of)" ]; then return 0; fi
  echo "[setup] building $env (MMEngine stack)"
  rm -rf "$env"; "$PY" -m venv "$env"
  pip_in "$env" 'torch==2.13.0'
  pip_in "$env" 'setuptools<81' wheel
  pip_in "$env" 'mmengine==0.10.7' pytest 'ruff==0.8.6' 'vermin==1.9.2' matplotlib 'numpy<2.3' 'tensorboard==2.21.0'
  MMCV_WITH_OPS=0 pip_in "$env" --no-build-isolation 'mmcv-lite==2.1.0'
  pip_in "$env" --no-deps 'mmdet==3.3.0' 'mmdet3d==1.4.0'
  pip_in "$env" --no-deps --no-build-isolation -e .
  stamp_of > "$env/.stamp"
}

build_mmcv1() {
  local env=.venv-mmcv1
  if [ -f "$env/.stamp" ] && [ "$(cat "$env/.stamp")" = "$(stamp_of)" ]; then return 0; fi
  echo "[setup] building $env (MMCV 1.x stack)"
  rm -rf "$env"; "$PY" -m venv "$env"
  pip_in "$env" 'torch==2.14.1' 'torchvision==0.29.1'
  pip_in "$env" 'setuptools<81' wheel
  pip_in "$env" pytest matplotlib 'numpy<2.3' 'tensorboard==2.21.0'
  MMCV_WITH_OPS=0 pip_in "$env" --no-build-isolation 'mmcv==1.7.2'
  # mmengine without its heavy dependencies (opencv): its registry and hooks import, which is what is tested.
  pip_in "$env" --no-deps 'mmengine==0.10.7' addict yapf termcolor rich markdown-it-py mdurl pygments
  pip_in "$env" --no-deps --no-build-isolation -e .
  stamp_of > "$env/.stamp"
}

case "$which_envs" in
  mmengine) build_mmengine ;;
  mmcv1) build_mmcv1 ;;
  all) build_mmengine; build_mmcv1 ;;
  *) echo "usage: $0 [all|mmengine|mmcv1]" >&2; exit 2 ;;
esac
