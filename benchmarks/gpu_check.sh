#!/usr/bin/env bash
# The prepared GPU check (under 5 minutes): the cuda test group under both runner families, and the benchmark,
# summed up in one small file, $OUT/gpu_check.md (logs beside it).
#
# Here, beforehand:   bash benchmarks/build_gpu_wheels.sh     (wheelhouse/, ~2 MB: what the GPU machine lacks)
# With the device tool:
#   run(command='bash benchmarks/gpu_check.sh "$OUT"', carry=['wheelhouse'], timeout_s=420)
# On any GPU machine with torch, from the repository root:  bash benchmarks/gpu_check.sh [OUT_DIR]
# Without a GPU it still runs every step (a dry run: the cuda tests skip, the benchmark runs small on the CPU).
#
# MMEngine's stack (mmengine + mmcv-lite) and MMCV 1.7.2 are both `mmcv`: each goes into its own --target folder,
# put in front of the machine's own packages with PYTHONPATH for its pass only.
set -uo pipefail
out=${1:-${OUT:-gpu_results}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
summary="$out/gpu_check.md"
cuda=$($py -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
{
  echo "# GPU check, $(date -u +%FT%TZ)"
  [ "$cuda" = 1 ] || echo "DRY RUN: no CUDA device here; the cuda tests skip and the benchmark runs small on the CPU"
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4
  $py -c "import sys, torch, numpy; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', \
torch.version.cuda, '| numpy', numpy.__version__, '| gpus', torch.cuda.device_count())"
  echo "CPU cores: $(nproc)"
  echo '```'
} > "$summary"

section() {  # section TITLE LOG: the log's closing lines into the summary
  { echo; echo "## $1"; echo '```'; grep -E "passed|failed|skipped|error|SKIPPED|FAILED|ERROR|rc=" "$2" | tail -n 25
    echo '```'; } >> "$summary"
}

for stack in mmengine mmcv1; do
  site=/tmp/petr_stability_site_$stack
  rm -rf "$site"
  if [ -d wheelhouse/$stack ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      wheelhouse/common/*.whl wheelhouse/$stack/*.whl > "$out/pip_$stack.log" 2>&1 \
      || { echo "pip install failed for $stack" >> "$summary"; cat "$out/pip_$stack.log" >> "$summary"; }
  fi
  # The installed project is tested (not the tree): the tests run from the repository, the package from $site.
  export PYTHONPATH="$site${PYTHONPATH_BASE:+:$PYTHONPATH_BASE}"
  $py -c "import petr_stability, mmcv; print('petr_stability from', petr_stability.__file__, '| mmcv', mmcv.__version__)" \
    > "$out/tests_$stack.log" 2>&1
  timeout 120 $py -P -m pytest -m cuda tests/cuda -q -rs -p no:cacheprovider --import-mode=importlib \
    >> "$out/tests_$stack.log" 2>&1
  echo "rc=$?" >> "$out/tests_$stack.log"
  head -1 "$out/tests_$stack.log" >> "$summary"
  section "cuda tests, $stack stack" "$out/tests_$stack.log"
  if [ $stack = mmengine ]; then
    if [ "$cuda" = 1 ]; then bench=(--device cuda); else bench=(--device cpu --rounds 1 --block 5); fi
    timeout 90 $py benchmarks/bench.py "${bench[@]}" --json "$out/bench.json" > "$out/bench.log" 2>&1
    echo "rc=$?" >> "$out/bench.log"
    { echo; echo "## benchmark (benchmarks/bench.py ${bench[*]})"; echo '```'; cat "$out/bench.log"; echo '```'
    } >> "$summary"
  fi
done
unset PYTHONPATH
cat "$summary"
