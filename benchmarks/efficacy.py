"""Does a guarded run end where a stable one would? The demo's scenarios over seeds and CPU kernel sets (issue 35).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/efficacy.py [--seeds 0 1 2 3 4] [--kernels native default]
        [--scenarios dynamics data_burst] [--runs guarded reference ...] [--guard-kwargs JSON] [--json out.json]

For each scenario, seed and kernel set (``native``: this CPU's best kernels; ``default``: torch's portable ones,
``ATEN_CPU_CAPABILITY=default``, what another CPU computes), the demo's real MMEngine runs (petr_stability.demo.run):
``guarded`` (the guard on), ``reference`` (dynamics: the stable learning rate, no guard), ``known_fix`` (the known
manual fix (transformer dropout 0, max_norm 1) from the start, no guard), ``unguarded``, ``reshuffled`` (dynamics: the
reference on the frame stream a third of a run further on, held to the guarded run's comparison: how far the reference
lands from itself on other frames of the same data, as a rollback's replayed iterations see them), ``remedied``
(dynamics: the guard's answer to the scenario's overflow from the first iteration, no guard: the decoder layers in fp32
and the rate x ``overflow_lr_backoff``; the best a recovery with that answer can end, held to the same comparison). Each
kernel set runs in a process of its own (the kernels are chosen as torch starts). Printed per scenario and kernel set:
the held-out loss's median and max over the seeds for each run (NaN where a run was lost), how many were lost, the
guard's iterations lost per incident, and the wall time; then guarded / reference (median, and the worst guarded against
the reference's own spread). Ratios are measured in one invocation, on this machine. ``--guard-kwargs`` passes further
``NanGuardHook`` arguments to the guarded runs (``'{"diagnose": false, "lr_rewarm": 20}'``: the dynamics ladder, with
the learning rate given back; docs/demo.md); each row also names the divergences' classes, the ladder's rungs that held
and the guard's learning-rate factor at the end.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

from zoo import GROUPS, as_few_note, compare, needed, spread_chance  # benchmarks/zoo.py, beside this script

__all__ = ["main", "one_kernel_set", "summarize"]

RUNS = ("guarded", "reference", "known_fix", "unguarded", "reshuffled", "remedied")
#: Runs held to the guarded run's comparison with the reference: what the criteria allow by design.
FLOORS = {"reshuffled": "the reference on later frames", "remedied": "the guard's answer from the start"}


def one_kernel_set(scenarios: List[str], seeds: List[int], runs: Sequence[str] = RUNS,
                   guard_kwargs: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Every (scenario, seed, run) in this process's kernels: one row each."""
    import dataclasses

    from petr_stability.demo import run as demo

    warnings.simplefilter("ignore")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for scenario in scenarios:
            for seed in seeds:
                base = demo.settings_for(scenario)
                chosen = tuple(r for r in runs if r in demo.RUNS
                               and (r not in ("reference", *FLOORS) or scenario == "dynamics"))
                s = dataclasses.replace(base, seed=seed, runs=chosen, guard=dict(base.guard, **(guard_kwargs or {})))
                train, heldout = demo._make_data(s)
                for key in s.runs:
                    t0 = time.perf_counter()
                    r = demo._run_one(key, root, s, train, heldout, echo=False)
                    rows.append({"scenario": scenario, "seed": seed, "run": key, "lost": r.lost,
                                 "eval_loss": r.eval_loss, "incidents": r.incidents,
                                 "iters_lost_per_incident": list(r.iters_lost_per_incident),
                                 "causes": list(r.causes), "held": list(r.held), "lr_factor": r.lr_factor,
                                 "wall_s": round(time.perf_counter() - t0, 2)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


#: Seeds reported apart: a number tuned on 0-9 is shown on 10-19 too (issue 43), and on every seed run.
SEED_GROUPS = GROUPS + (("all", range(0, 1 << 30)),)


def _group(rows: List[Dict[str, Any]], seeds: range) -> Dict[str, Any]:
    """Guarded against reference over the seeds in ``seeds`` (zoo.py's comparison; a lost guarded run is outside
    the spread, a lost reference run is left out of it), and how many guarded runs were lost."""
    mine = [r for r in rows if r["seed"] in seeds]
    guarded = [r for r in mine if r["run"] == "guarded"]
    reference = [r for r in mine if r["run"] == "reference" and not r["lost"]]
    out = dict(compare(guarded, reference), guarded_lost=sum(r["lost"] for r in guarded))
    for run in FLOORS:  # held to the guarded run's comparison: what the criteria allow by design
        these = [r for r in mine if r["run"] == run]
        if these:
            out[run] = compare(these, reference)
    return out


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per (kernels, scenario): each run's held-out loss over the seeds, losses, iterations lost per incident, wall
    time; guarded against reference."""
    out: Dict[str, Any] = {}
    for kernels in sorted({r["kernels"] for r in rows}):
        for scenario in sorted({r["scenario"] for r in rows}):
            mine = [r for r in rows if r["kernels"] == kernels and r["scenario"] == scenario]
            part: Dict[str, Any] = {}
            for run in RUNS:
                these = [r for r in mine if r["run"] == run]
                if not these:
                    continue
                finite = [r["eval_loss"] for r in these if r["eval_loss"] is not None and not r["lost"]]
                part[run] = {"seeds": len(these), "lost": sum(r["lost"] for r in these),
                             "median": _median(finite), "max": max(finite) if finite else None,
                             "min": min(finite) if finite else None,
                             "iters_lost_per_incident": [i for r in these for i in r["iters_lost_per_incident"]],
                             "wall_s": round(sum(r["wall_s"] for r in these), 1)}
            g, ref = part.get("guarded"), part.get("reference")
            if g and ref and g["median"] and ref["median"]:
                part["guarded_vs_reference_median"] = g["median"] / ref["median"]
                part["guarded_worst_within_reference_spread"] = g["max"] is not None and g["max"] <= ref["max"]
            if ref and ref["median"] and (g or any(part.get(run) for run in FLOORS)):
                part["seed_groups"] = {name: _group(mine, chosen) for name, chosen in SEED_GROUPS
                                       if any(r["seed"] in chosen for r in mine)}
            out[f"{kernels}/{scenario}"] = part
    return out


def _fmt(x: Optional[float]) -> str:
    return "NaN" if x is None else f"{x:.3f}"


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--kernels", nargs="+", default=["native", "default"], choices=["native", "default"])
    p.add_argument("--scenarios", nargs="+", default=["dynamics", "data_burst"], choices=["dynamics", "data_burst"])
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--guard-kwargs", type=json.loads, default={}, help="JSON object of NanGuardHook arguments")
    p.add_argument("--json", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: this kernel set, rows on stdout
    a = p.parse_args(argv)
    if not isinstance(a.guard_kwargs, dict):
        p.error(f"--guard-kwargs must be a JSON object, got {a.guard_kwargs!r}")
    if a.one:
        print(json.dumps(one_kernel_set(a.scenarios, a.seeds, a.runs, a.guard_kwargs)))
        return
    rows: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    for kernels in a.kernels:
        env = dict(os.environ)
        if kernels == "default":
            env["ATEN_CPU_CAPABILITY"] = "default"
        cmd = [sys.executable, __file__, "--one", "--seeds", *map(str, a.seeds), "--scenarios", *a.scenarios,
               "--runs", *a.runs, "--guard-kwargs", json.dumps(a.guard_kwargs)]
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        rows += [dict(r, kernels=kernels) for r in json.loads(done.stdout.strip().splitlines()[-1])]
    summary = summarize(rows)
    for key, part in summary.items():
        print(f"{key}:")
        for run in RUNS:
            if run in part:
                r = part[run]
                print(f"  {run:<10} median {_fmt(r['median'])} max {_fmt(r['max'])} lost {r['lost']}/{r['seeds']} "
                      f"iters lost per incident {r['iters_lost_per_incident'] or '-'} wall {r['wall_s']}s")
        if "guarded_vs_reference_median" in part:
            print(f"  guarded / reference (medians): {part['guarded_vs_reference_median']:.3f}; guarded worst within "
                  f"the reference's spread: {part['guarded_worst_within_reference_spread']}")
        for name, grp in part.get("seed_groups", {}).items():
            if grp["seeds"]:
                print(f"  seeds {name:<5}: guarded / reference (medians) {_fmt(grp['ratio'])}; guarded lost "
                      f"{grp['guarded_lost']}/{grp['seeds']}; inside the reference's spread "
                      f"[{_fmt(grp['reference_min'])}, {_fmt(grp['reference_max'])}]: "
                      f"{grp['inside_spread']}/{grp['seeds']} (below it: {grp['below_spread']})" + as_few_note(grp))
            if name == "all" and grp["seeds"] and grp["reference_runs"] > 1:
                need = needed(grp["seeds"])
                print(f"  seeds all  : runs as good as the reference's own have {need} of {grp['seeds']} inside its "
                      f"spread with chance {spread_chance(grp['reference_runs'], grp['seeds'], need):.3f} (exactly, "
                      "whatever their distribution: benchmarks/zoo.py's spread_chance)")
            for run, what in FLOORS.items():
                other = grp.get(run)
                if other:
                    print(f"  seeds {name:<5}: {what} / reference (medians) {_fmt(other['ratio'])}; inside the "
                          f"reference's spread {other['inside_spread']}/{other['seeds']} (below it: "
                          f"{other['below_spread']})")
    print(f"total wall {time.perf_counter() - t0:.0f}s")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
