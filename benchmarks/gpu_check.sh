#!/usr/bin/env bash
# One prepared GPU check (< 5 min): the cuda test group and the benchmark, results into one small file.
# On the GPU machine (its own Python/torch, no mmengine/mmcv, no network), install the wheels built beforehand
# by `bash benchmarks/build_gpu_wheels.sh` (carried as wheelhouse/), then run this from the repository root:
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# With the device tool: build the wheelhouse here (59 MB, measured), then
#   run(command='bash benchmarks/gpu_check.sh "$OUT"', carry=['wheelhouse'], timeout_s=420)
set -uo pipefail
out=${1:-${OUT:-gpu_results}}
mkdir -p "$out"
py=${PYTHON:-python3}
{
  echo "# GPU check $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $py -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$out/machine.txt"
if [ -d wheelhouse ]; then
  $py -m pip install -q --no-index --find-links wheelhouse --no-deps wheelhouse/*.whl > "$out/pip.txt" 2>&1
fi
$py -m pip install -q --no-deps --no-build-isolation -e . >> "$out/pip.txt" 2>&1
timeout 150 $py benchmarks/bench.py --device cuda --json "$out/bench.json" > "$out/bench.txt" 2>&1
echo "bench rc=$?" >> "$out/machine.txt"
timeout 150 $py -m pytest -q -m cuda tests/cuda -p no:cacheprovider > "$out/cuda_tests.txt" 2>&1
echo "cuda tests rc=$?" >> "$out/machine.txt"
cat "$out/machine.txt" "$out/bench.txt"; tail -5 "$out/cuda_tests.txt"
