"""Sweep of the demo's ``dynamics`` scenario through the real MMEngine runs: which learning rates lose which run.

``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/demo_sweep.py --lrs 5.5e-2 7e-2 --runs unguarded known_fix``
prints one line per (lr, run): finished, state finite, held-out eval loss, skipped steps, incidents, wall time;
for a guarded run also each divergence's class, the ladder's rungs that held and the guard's learning-rate factor.
``--guard-remedies dropout rollback`` runs the guarded runs with a subset of the guard's remedies;
``--guard-kwargs '{"diagnose": false}'`` passes further ``NanGuardHook`` arguments (``diagnose=False``: no
replay, every divergence is ``unknown`` and takes the dynamics ladder).
"""
import argparse
import dataclasses
import json
import tempfile
import warnings
from typing import List, Optional

from petr_stability.demo import run as demo

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> None:
    """Runs the sweep and prints the lines."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lrs", type=float, nargs="+", required=True)
    p.add_argument("--runs", nargs="+", default=["unguarded", "known_fix"], choices=list(demo.RUNS))
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--guard-remedies", nargs="+", default=None)
    p.add_argument("--guard-kwargs", type=json.loads, default={}, help="JSON object of NanGuardHook arguments")
    a = p.parse_args(argv)
    if not isinstance(a.guard_kwargs, dict):
        p.error(f"--guard-kwargs must be a JSON object, got {a.guard_kwargs!r}")
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as root:
        for lr in a.lrs:
            s = dataclasses.replace(demo.settings_for("dynamics", a.iters), lr=lr, runs=tuple(a.runs))
            s.guard = dict(s.guard, **a.guard_kwargs)
            if a.guard_remedies:
                s.guard["remedies"] = list(a.guard_remedies)
            train, heldout = demo._make_data(s)
            for key in s.runs:
                r = demo._run_one(key, root, s, train, heldout, echo=False)
                ev = "NaN/Inf" if r.eval_loss is None else f"{r.eval_loss:.3f}"
                guard = (f" causes {','.join(r.causes) or '-'} held {'; '.join(r.held) or '-'} "
                         f"lr_factor {r.lr_factor:g}") if key in ("guarded", "adaptive_clip") else ""
                print(f"lr {lr:g} {key:<13} finished {r.finished} finite {r.state_finite} eval {ev} "
                      f"skipped {r.skipped_steps} incidents {r.incidents} lost_iters {r.iters_lost} "
                      f"lost {r.lost} {r.wall_s:.1f}s {r.outcome}{guard}", flush=True)


if __name__ == "__main__":
    main()
