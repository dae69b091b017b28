#!/usr/bin/env bash
# The prepared GPU check (under 5 minutes): the cuda test group under both runner families, and the benchmark,
# summed up in one small file, $OUT/gpu_check.md (logs beside it).
#
# Here, beforehand:   bash benchmarks/build_gpu_wheels.sh     (wheelhouse/, 2.4 MB: what the GPU machine lacks)
# With the device tool:
#   run(command='bash benchmarks/gpu_check.sh "$OUT"', carry=['wheelhouse'], timeout_s=480)
# On any GPU machine with torch, from the repository root:  bash benchmarks/gpu_check.sh [OUT_DIR]
# Without a GPU it still runs every step (a dry run: the cuda tests skip, the benchmark runs small on the CPU);
# with PETR_STABILITY_CUDA_REHEARSAL=1 the dry run also runs the cuda tests' code on the CPU stand-ins.
#
# MMEngine's stack (mmengine + mmcv-lite) and MMCV 1.7.2 are both `mmcv`: each goes into its own --target folder,
# put in front of the machine's own packages with PYTHONPATH for its pass only.
set -uo pipefail
out=${1:-${OUT:-gpu_results}}
mkdir -p "$out"
py=${PYTHON:-python3}
# PYTHONSAFEPATH (Python >= 3.11; older ones ignore it): the working directory is not put first on sys.path, so
# the installed package is imported and tested, not the tree's copy.
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONSAFEPATH=1
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

# The project's wheel, built here from the tree that travelled (setuptools is on the machine): never stale.
wheel_dir=/tmp/petr_stability_wheel
rm -rf "$wheel_dir" build
$py -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$wheel_dir" . > "$out/pip_project.log" 2>&1 \
  || { echo "building the project's wheel failed:"; tail -n 5 "$out/pip_project.log"; } >> "$summary"
rm -rf build

for stack in mmengine mmcv1; do
  site=/tmp/petr_stability_site_$stack
  rm -rf "$site"
  # Without a wheelhouse the machine's own mmengine / mmcv are used, and only the project goes into $site.
  wheels=("$wheel_dir"/*.whl)
  [ -d wheelhouse/$stack ] && wheels+=(wheelhouse/common/*.whl wheelhouse/$stack/*.whl)
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "${wheels[@]}" > "$out/pip_$stack.log" 2>&1 \
    || { echo "pip install failed for $stack:"; tail -n 5 "$out/pip_$stack.log"; } >> "$summary"
  # The wheel does not ship the repository's test helpers (petr_stability.testing): the tests take the tree's copy,
  # put beside the installed package.
  [ -d "$site/petr_stability" ] && cp -r petr_stability/testing "$site/petr_stability/"
  # The installed project is tested (not the tree): the tests run from the repository, the package from $site.
  export PYTHONPATH="$site${PYTHONPATH_BASE:+:$PYTHONPATH_BASE}"
  if ! $py -c "import petr_stability, mmcv; print('$stack stack: petr_stability from', petr_stability.__file__, \
'| mmcv', mmcv.__version__)" > "$out/tests_$stack.log" 2>&1; then
    { echo "$stack stack does not import:"; echo '```'; tail -n 4 "$out/tests_$stack.log"; echo '```'; } >> "$summary"
  fi
  timeout 150 $py -m pytest -m cuda tests/cuda -q -rs -p no:cacheprovider --import-mode=importlib \
    >> "$out/tests_$stack.log" 2>&1
  echo "rc=$?" >> "$out/tests_$stack.log"
  grep -m1 "stack: petr_stability from" "$out/tests_$stack.log" >> "$summary"
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
