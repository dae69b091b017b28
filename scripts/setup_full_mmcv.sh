#!/usr/bin/env bash
# Opt-in: .venv-fullmmcv with mmcv 2.1.0 *built with its compiled ops* (~17 min on 2 cores), so that
# `import mmdet3d.models` works and a default_scope='mmdet3d' Runner can be built. Not part of `make test`.
#   bash scripts/setup_full_mmcv.sh && make test-mmdet3d-scope
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
env=.venv-fullmmcv
if [ -f "$env/.done" ]; then exit 0; fi
rm -rf "$env"; "$PY" -m venv "$env"
"$env/bin/pip" install -q 'torch==2.13.0'
"$env/bin/pip" install -q 'setuptools<81' wheel ninja
"$env/bin/pip" install -q 'mmengine==0.10.7' pytest 'numpy<2.3' numba terminaltables shapely trimesh plyfile scipy \
  pyquaternion scikit-image matplotlib pycocotools tqdm six
MMCV_WITH_OPS=1 MAX_JOBS=2 "$env/bin/pip" install -q --no-build-isolation 'mmcv==2.1.0'
"$env/bin/pip" install -q --no-deps 'mmdet==3.3.0' 'mmdet3d==1.4.0'
"$env/bin/pip" install -q --no-deps --no-build-isolation -e .
touch "$env/.done"
