#!/usr/bin/env bash
# The Python floor the users' stacks need (StreamPETR documents Python 3.8), held statically: only Python 3.11
# installs here. vermin checks syntax and library use (functools.cache, math.lcm, dict | dict, builtin generics in
# annotations: --eval-annotations because this package evaluates its annotations at definition time, it has no
# `from __future__ import annotations`). It cannot type receivers: str.removeprefix on a variable passes. Not
# --feature union-types: that heuristic reads os.O_WRONLY | os.O_CREAT as a 3.10 union; ruff's FA102 finds
# `X | Y` annotations exactly.
# The torch floor (1.9) is held by tests/core/test_floor.py in `make test` (docs/versions.md has both).
#   usage: bash scripts/check_floor.sh [paths...]   (default: the package and its command, petr_stability_cli.py; VERMIN=path overrides the binary)
set -euo pipefail
cd "$(dirname "$0")/.."
VERMIN=${VERMIN:-.venv/bin/vermin}
if [ ! -x "$VERMIN" ] && ! command -v "$VERMIN" >/dev/null; then
  echo "check_floor: $VERMIN not found (scripts/setup_envs.sh installs vermin==1.9.2 into .venv)" >&2
  exit 2
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(petr_stability petr_stability_cli.py)
"$VERMIN" --target=3.8- --violations --no-tips --eval-annotations -q "${targets[@]}"
echo "check_floor: ${targets[*]} needs nothing newer than Python 3.8 (vermin $("$VERMIN" --version))"
