#!/usr/bin/env bash
# Opt-in: .venv-seed, the seed document's own stack on CPU, for `make test-seed-stack` (not part of `make test`).
#   torch 2.14.1 + torchvision 0.29.1 (this machine's local disk), mmcv-full 1.7.2 built from PyPI's source package
#   with its CPU ops (~15 min on 2 cores), mmdet 2.28.2, mmsegmentation 0.30.0, mmdet3d 1.0.0rc6 (--no-deps, pure
#   Python), the runtime packages mmdet3d's import needs, and fvcore / einops / IPython for StreamPETR's plugin.
# Two edits to upstream source packages, both made on the unpacked copy under .venv-seed/src before it is built:
#   - mmcv-full 1.7.2's setup.py asks for -std=c++14/17; torch 2.14's headers need C++20.
#   - mmdet3d 1.0.0rc6 refuses mmcv > 1.7.0 at import; its cap is raised to 1.7.2 (the API did not change).
# Idempotent: each step leaves a stamp in .venv-seed/.steps and a finished env is kept (stamped by this file's hash).
#   bash scripts/setup_seed_stack.sh && STREAMPETR_ROOT=... PETR_ROOT=... make test-seed-stack
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
env=.venv-seed
stamp=$(sha1sum "$0" | cut -c1-12)
if [ -f "$env/.stamp" ] && [ "$(cat "$env/.stamp")" = "$stamp" ]; then exit 0; fi
pip_in() { "$env/bin/pip" install -q "$@" 2> >(grep -v 'is ignored: it is neither' >&2); }
# step NAME CMD...: runs CMD once; a stamp under .steps keeps a finished step across reruns of a broken build.
step() {
  local name=$1; shift
  if [ -f "$env/.steps/$name" ]; then return 0; fi
  local t0=$SECONDS
  echo "[seed-stack] $name"
  "$@"
  touch "$env/.steps/$name"
  echo "[seed-stack] $name done in $((SECONDS - t0)) s"
}
t_start=$SECONDS
if [ ! -x "$env/bin/python" ]; then rm -rf "$env"; "$PY" -m venv "$env"; fi
mkdir -p "$env/.steps" "$env/src"

base() {
  pip_in 'torch==2.14.1' 'torchvision==0.29.1'
  pip_in 'setuptools<81' wheel ninja pytest 'numpy<2.3' 'opencv-python-headless<4.12'
}

mmcv_full() {
  local src=$env/src
  rm -rf "$src/mmcv-full-1.7.2"
  "$env/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation -d "$src" 'mmcv-full==1.7.2' \
    2> >(grep -v 'is ignored: it is neither' >&2)
  tar -xzf "$src/mmcv-full-1.7.2.tar.gz" -C "$src"
  sed -i -E 's/-std=c\+\+1[47]/-std=c++20/g' "$src/mmcv-full-1.7.2/setup.py"
  grep -q -- '-std=c++20' "$src/mmcv-full-1.7.2/setup.py"
  MMCV_WITH_OPS=1 FORCE_CUDA=0 MAX_JOBS=2 pip_in --no-build-isolation "$src/mmcv-full-1.7.2"
}

mmdet_mmseg() {
  # mmdet / mmseg runtime needs, then the two packages without their (mmcv-full-pulling) pins.
  pip_in matplotlib scipy six terminaltables pycocotools shapely prettytable packaging
  pip_in --no-deps 'mmdet==2.28.2' 'mmsegmentation==0.30.0'
}

mmdet3d_rc6() {
  local src=$env/src
  rm -rf "$src/mmdet3d-1.0.0rc6"
  "$env/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation -d "$src" 'mmdet3d==1.0.0rc6' \
    2> >(grep -v 'is ignored: it is neither' >&2)
  tar -xzf "$src/mmdet3d-1.0.0rc6.tar.gz" -C "$src"
  sed -i -E "s/^mmcv_maximum_version = '1\.7\.0'/mmcv_maximum_version = '1.7.2'/" "$src/mmdet3d-1.0.0rc6/mmdet3d/__init__.py"
  grep -q "mmcv_maximum_version = '1.7.2'" "$src/mmdet3d-1.0.0rc6/mmdet3d/__init__.py"
  # Its own pins of numba / networkx / trimesh have no Python 3.11 wheels: the current releases are used.
  pip_in numba networkx trimesh plyfile scikit-image 'lyft_dataset_sdk' 'nuscenes-devkit' --no-deps
  pip_in llvmlite pyquaternion cachetools descartes fire tqdm scikit-learn Pillow tensorboard
  pip_in --no-deps --no-build-isolation "$src/mmdet3d-1.0.0rc6"
}

plugin_deps() {
  pip_in fvcore einops IPython
  pip_in --no-deps --no-build-isolation -e .
}

train_deps() {
  # mmdet3d.datasets (which the projects' training imports, unlike mmdet3d.models) imports pandas (lyft_dataset).
  pip_in pandas
}

check() {
  "$env/bin/python" - <<'EOF'
import mmcv, mmdet, mmseg, mmdet3d, torch
from mmcv.ops import nms  # compiled CPU ops
import mmdet3d.models  # noqa: F401
import mmdet3d.datasets, mmdet3d.apis  # noqa: F401,E401  (what tools/train.py of both projects imports)
import petr_stability  # noqa: F401
print(f'[seed-stack] torch {torch.__version__}, mmcv-full {mmcv.__version__}, mmdet {mmdet.__version__}, '
      f'mmseg {mmseg.__version__}, mmdet3d {mmdet3d.__version__}')
EOF
}

step base base
step mmcv-full mmcv_full
step mmdet-mmseg mmdet_mmseg
step mmdet3d mmdet3d_rc6
step plugin-deps plugin_deps
step train-deps train_deps
check
echo "[seed-stack] $env ready in $((SECONDS - t_start)) s, $(du -sh "$env" | cut -f1) on disk"
echo "$stamp" > "$env/.stamp"
