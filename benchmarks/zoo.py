"""The guard on the model zoo (petr_stability/testing/zoo.py): every model x scenario x variant x seed, per CPU kernel
set, and the criteria it is held to.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zoo.py [--seeds 0-19] [--models causal_ts,detr,...]
        [--scenarios none,too_high_lr,...] [--kernels native,default] [--guard-kwargs JSON]
        [--out docs/results/zoo_<name>_cpu.json]
    .venv/bin/python benchmarks/zoo.py --rows A.json B.json --out merged.json   # summarize runs already made
        (a run in B replaces the same run in A: re-run cells on newer code, list the newer file last)

Each kernel set runs in a process of its own (``native``: this CPU's best kernels; ``default``: torch's portable ones,
``ATEN_CPU_CAPABILITY=default``; torch picks them as it starts). Per model and seed one ``reference`` run (the
stable learning rate, nothing planted, no guard) and one ``reshuffled`` run (the reference with its batches in
another order); per scenario an ``unguarded`` run (the fault planted, no guard; for ``none`` the reference is that
run) and a ``guarded`` one. Printed per kernel set, model and scenario:
unguarded lost n/N, guarded lost n/N, false stops (the guard raised), the classes seen, quarantined samples (runs
whose quarantine is exactly the planted sample / runs with a wrong one), incidents where nothing was planted, the
guarded median held-out loss over the reference's (the ratio) and how many guarded runs lie inside the reference's
own min-max over the same seeds, for seeds 0-9 and 10-19 apart and together; then PASS or FAIL on the criteria:

- every model x scenario: unguarded lost where a fault is planted; guarded: no false stop, no incident where
  nothing is planted, the right class (:func:`petr_stability.testing.zoo.right_class`);
- over all the seeds run: no guarded run lost, the guarded median within 5% of the reference's, and at least 90%
  of the guarded runs (18 of 20) inside the reference's own spread.

Beside each cell, the same two quality criteria applied to the reshuffled reference: how far the reference lands from
itself when nothing but the order of its batches changes. A rollback replays its iterations on the batches the loader
moved on to, so where the reshuffled reference misses a criterion, no recovery can be held to it on that model. Where
a data scenario is run, one ``without`` run per model and seed too (the reference without the sample the fault is
planted in): a guarded run quarantines the sample at its first serving at best, and trains on the rest; its data
cells are held to that floor as well.

The raw rows (one per run, every field of ``ZooResult``) and the summary go to ``--out`` as JSON.
"""
import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["main", "parse_seeds", "one_kernel_set", "summarize", "criteria", "quality", "compare", "markdown",
           "GROUPS", "merged", "needed", "median_met", "spread_met", "spread_chance", "as_few_inside", "as_few_note",
           "chance_to_pass", "chances"]

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS = (("0-9", range(0, 10)), ("10-19", range(10, 20)))
#: The floors a cell is also held to: variant -> (how the report names it, its label in the markdown table). The
#: ``without`` floor only where a data scenario (``zoo.DATA_SCENARIOS``) is run, and only for those cells.
FLOORS = {"reshuffled": ("the reference in another order", ""),
          "without": ("the reference without the planted sample", "without the sample: ")}


def parse_seeds(text: str) -> List[int]:
    """``'0-19'``, ``'0,3,5'`` or ``'0-2,7'`` -> the seeds, in order, each once."""
    seeds: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        for s in range(int(lo), int(hi or lo) + 1):
            if s not in seeds:
                seeds.append(s)
    if not seeds:
        raise ValueError(f"no seeds in {text!r}")
    return seeds


def _names(text: str, allowed: Sequence[str], what: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(f"unknown {what} {unknown or text!r}; choose from {list(allowed)}")
    return names


def one_kernel_set(models: List[str], scenarios: List[str], seeds: List[int],
                   guard_kwargs: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Every run in this process's kernels: one JSON-ready row each (progress on stderr)."""
    from petr_stability.testing import zoo

    warnings.simplefilter("ignore")
    rows = []
    for model in models:
        for seed in seeds:
            plan: List[Tuple[str, str]] = [("none", "reference"), ("none", "reshuffled")]
            plan += [("none", "without")] if set(scenarios) & set(zoo.DATA_SCENARIOS) else []
            for scenario in scenarios:
                plan += [(scenario, "unguarded")] if scenario != "none" else []
                plan += [(scenario, "guarded")]
            for scenario, variant in plan:
                row = zoo.result_dict(zoo.run(model, scenario, variant, seed, guard_kwargs=guard_kwargs))
                rows.append(row)
                print(f"{model:<9} {scenario:<14} {variant:<9} seed {seed:>2}: lost {row['lost']!s:<5} "
                      f"eval {row['eval_loss']} error {row['error_type']} causes {row['causes']} "
                      f"{row['wall_s']}s", file=sys.stderr, flush=True)
    return rows


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _evals(rows: List[Dict[str, Any]]) -> List[float]:
    return [r["eval_loss"] for r in rows if r["eval_loss"] is not None and not r["lost"]]


def compare(guarded: List[Dict[str, Any]], reference: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Guarded against the reference over one set of seeds (rows with ``eval_loss`` and ``lost``, as this script's and
    efficacy.py's are): median ratio, runs inside the reference's min-max, and of the others those below it."""
    ref = [r["eval_loss"] for r in reference if r["eval_loss"] is not None]
    g_med, r_med = _median(_evals(guarded)), _median(ref)
    lo, hi = (min(ref), max(ref)) if ref else (None, None)
    inside = sum(1 for r in guarded if r["eval_loss"] is not None and not r["lost"] and lo <= r["eval_loss"] <= hi) \
        if ref else 0
    # Outside the spread on the better side is still outside (the criterion is two-sided), but it is no harm: counted
    # apart, so a reader sees which way a miss goes.
    below = sum(1 for r in guarded if r["eval_loss"] is not None and not r["lost"] and lo > r["eval_loss"]) \
        if ref else 0
    return {"seeds": len(guarded), "guarded_median": g_med, "reference_median": r_med,
            "ratio": g_med / r_med if g_med is not None and r_med else None,
            "reference_min": lo, "reference_max": hi, "inside_spread": inside, "below_spread": below,
            "reference_runs": len(ref)}


def _result(row: Dict[str, Any]) -> Any:
    """A raw row back as a ``ZooResult``."""
    from petr_stability.testing.zoo import ZooResult

    return ZooResult(**{k: v for k, v in row.items() if k in ZooResult.__dataclass_fields__})


def _cell(rows: List[Dict[str, Any]], model: str, scenario: str) -> Dict[str, Any]:
    """One model x scenario in one kernel set."""
    from petr_stability.testing.zoo import acted, right_class

    reference = [r for r in rows if r["model"] == model and r["variant"] == "reference"]
    unguarded = reference if scenario == "none" else [
        r for r in rows if r["model"] == model and r["scenario"] == scenario and r["variant"] == "unguarded"]
    guarded = [r for r in rows if r["model"] == model and r["scenario"] == scenario and r["variant"] == "guarded"]
    classes: Dict[str, int] = {}
    for r in guarded:
        for c in r["causes"]:
            classes[c] = classes.get(c, 0) + 1
    wrong_class = []
    for r in guarded:
        ok, why = right_class(_result(r))
        if not ok:
            wrong_class.append({"seed": r["seed"], "why": why})
    planted = [r for r in guarded if r["planted"] is not None]
    out = {
        "unguarded_lost": sum(r["lost"] for r in unguarded), "unguarded_runs": len(unguarded),
        "guarded_lost": sum(r["lost"] for r in guarded), "guarded_runs": len(guarded),
        "false_stops": [{"seed": r["seed"], "error": r["error_type"], "message": (r["error_message"] or "")[:300]}
                        for r in guarded if not r["finished"]],
        "classes": classes,
        "quarantine_right": sum(1 for r in planted if r["quarantined"] == [r["planted"]]),
        "quarantine_wrong": sum(1 for r in guarded if any(i != r["planted"] for i in r["quarantined"])),
        "incidents_unplanted": sum(1 for r in guarded if scenario == "none" and acted(_result(r))),
        "observations_unplanted": sum(1 for r in guarded if scenario == "none" and r["incidents"]
                                      and not acted(_result(r))),
        "wrong_class": wrong_class,
        "iters_lost": sum(r["iters_lost"] for r in guarded),
        "wall_s": round(sum(r["wall_s"] for r in guarded + unguarded), 1),
    }
    from petr_stability.testing.zoo import DATA_SCENARIOS

    floors = {variant: [r for r in rows if r["model"] == model and r["variant"] == variant] for variant in FLOORS
              if variant != "without" or scenario in DATA_SCENARIOS}
    seeds = sorted({r["seed"] for r in guarded})
    for name, group in GROUPS + (("all", seeds),):
        g = [r for r in guarded if r["seed"] in group]
        ref = [r for r in reference if r["seed"] in group]
        if g and (name == "all" or len(g) < len(guarded)):
            out[f"seeds_{name}"] = compare(g, ref)
            for variant, floor in floors.items():  # the same criteria on a floor: what they allow by design
                these = [r for r in floor if r["seed"] in group]
                if these:
                    out[f"{variant}_{name}"] = compare(these, ref)
    return out


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per kernel set, model and scenario: the counts and comparisons above."""
    out: Dict[str, Any] = {}
    for kernels in sorted({r["kernels"] for r in rows}):
        mine = [r for r in rows if r["kernels"] == kernels]
        for model in sorted({r["model"] for r in mine}):
            for scenario in [s for s in _order(mine) if any(r["scenario"] == s and r["model"] == model
                                                             and r["variant"] == "guarded" for r in mine)]:
                out[f"{kernels}/{model}/{scenario}"] = _cell([r for r in mine if r["model"] == model], model,
                                                             scenario)
    return out


def _order(rows: List[Dict[str, Any]]) -> List[str]:
    from petr_stability.testing.zoo import SCENARIOS

    return [s for s in SCENARIOS if any(r["scenario"] == s for r in rows)]


def criteria(key: str, cell: Dict[str, Any]) -> List[str]:
    """The criteria this cell fails (empty: PASS)."""
    scenario = key.split("/")[-1]
    fails = []
    if scenario != "none" and cell["unguarded_lost"] < cell["unguarded_runs"]:
        fails.append(f"unguarded lost only {cell['unguarded_lost']}/{cell['unguarded_runs']}")
    if cell["false_stops"]:
        fails.append(f"{len(cell['false_stops'])} false stop(s)")
    if cell["incidents_unplanted"]:
        fails.append(f"incidents in {cell['incidents_unplanted']} run(s) where nothing is planted")
    if cell["wrong_class"]:
        fails.append(f"wrong class in {len(cell['wrong_class'])} run(s)")
    if cell["guarded_lost"]:
        fails.append(f"guarded lost {cell['guarded_lost']}/{cell['guarded_runs']}")
    return fails + quality(cell["seeds_all"])


def needed(runs: int) -> int:
    """How many of ``runs`` runs the spread criterion needs inside the reference's spread: 90%, rounded up (18 of
    20)."""
    return -(-9 * runs // 10)


def median_met(total: Dict[str, Any]) -> bool:
    """The median criterion on ``total`` (a :func:`compare`): the median within 5% of the reference's."""
    return total["ratio"] is not None and abs(total["ratio"] - 1.0) <= 0.05


def spread_met(total: Dict[str, Any]) -> bool:
    """The spread criterion on ``total`` (a :func:`compare`): :func:`needed` of its runs inside the reference's
    spread."""
    return total["inside_spread"] >= needed(total["seeds"])


def quality(total: Dict[str, Any], who: str = "guarded") -> List[str]:
    """The quality criteria ``total`` (a :func:`compare` over all the seeds) fails: the median within 5% of the
    reference's, 90% of the runs inside the reference's spread."""
    fails = []
    if not median_met(total):
        fails.append(f"{who} median / reference median = {_fmt(total['ratio'])} (not within 5%)")
    if not spread_met(total):
        fails.append(f"{total['inside_spread']}/{total['seeds']} {who} runs inside the reference's spread "
                     f"(need {needed(total['seeds'])})")
    return fails


def spread_chance(reference_runs: int, runs: int, need: int) -> float:
    """The chance that at least ``need`` of ``runs`` runs as good as the reference's own (more draws from the same
    continuous distribution as its ``reference_runs``) lie inside the reference's min-max. It holds whatever that
    distribution is: the ranks of all the runs together are a uniformly random arrangement, and k of the runs lie
    outside in (k + 1) C(n - 2 + m - k, n - 2) of the C(n + m, n) arrangements (a of them below every reference run,
    k - a above it, the reference's n and the other m - k runs in between). 20 runs against 20, 18 needed: 0.698."""
    n, m = reference_runs, runs
    if n < 2:
        raise ValueError(f"a spread needs at least 2 reference runs, got reference_runs={n}")
    return sum((k + 1) * math.comb(n - 2 + m - k, n - 2) for k in range(0, m - need + 1)) / math.comb(n + m, n)


def as_few_inside(comparison: Dict[str, Any]) -> Optional[float]:
    """The chance that runs as good as the reference's own leave as few of theirs inside its spread as ``comparison``
    (a :func:`compare`) found, or fewer: how surprising its count is for a perfect recovery."""
    if comparison.get("reference_runs", 0) < 2:
        return None
    return 1.0 - spread_chance(comparison["reference_runs"], comparison["seeds"], comparison["inside_spread"] + 1)


def as_few_note(comparison: Dict[str, Any]) -> str:
    """:func:`as_few_inside` as the reports print it after a count inside the spread ("" where it has no value)."""
    chance = as_few_inside(comparison)
    return "" if chance is None else f"; as few or fewer for runs as good as the reference's: chance {chance:.2f}"


def chance_to_pass(reference: List[float], other: List[float], draws: int = 4000, seed: int = 0,
                   ratios: Sequence[float] = ()) -> Dict[str, Any]:
    """The chance that a recovery as good as the reference's own passes :func:`quality`'s criteria on one model, each
    and both: the reference's held-out losses and another set of runs of the same configuration (the reshuffled
    reference: its batches in another order) pooled and split at random ``draws`` times into a reference and a
    'recovered' set of their sizes. ``spread_exact`` is :func:`spread_chance` for those sizes (the split's ``spread``
    estimates it). ``as_far``: for each of ``ratios`` (a guarded median over the reference's), the chance that such a
    recovery's median ratio lies as far from 1 or farther (on the log scale, either way). The two sets share their
    seeds' initial weights, so the splits take them as a little closer than independent runs would be."""
    if len(reference) < 2 or not other:
        raise ValueError(f"needs at least 2 reference runs and 1 other, got {len(reference)} and {len(other)}")
    pooled, n, rng = list(reference) + list(other), len(reference), random.Random(seed)
    passed, distances = {"median": 0, "spread": 0, "both": 0}, []
    for _ in range(draws):
        rng.shuffle(pooled)
        split = compare([{"eval_loss": x, "lost": False} for x in pooled[n:]], [{"eval_loss": x} for x in pooled[:n]])
        if split["ratio"] and split["ratio"] > 0:  # a median of 0 or below has no log: no distance drawn
            distances.append(abs(math.log(split["ratio"])))
        median_ok, spread_ok = median_met(split), spread_met(split)
        passed["median"] += median_ok
        passed["spread"] += spread_ok
        passed["both"] += median_ok and spread_ok
    as_far = {r: sum(d >= abs(math.log(r)) - 1e-12 for d in distances) / len(distances) for r in ratios
              if r and r > 0 and distances}
    return dict({k: v / draws for k, v in passed.items()},
                spread_exact=spread_chance(n, len(other), needed(len(other))), draws=draws, as_far=as_far)


def chances(rows: List[Dict[str, Any]], summary: Dict[str, Any]) -> Dict[str, Any]:
    """Per kernel set and model with reshuffled runs: :func:`chance_to_pass`, and against it how many of the model's
    fault cells (every scenario but ``none``, whose guarded runs are the reference's) a recovery that good would pass
    on average (the sum of their chances) and how many the guard passes."""
    out: Dict[str, Any] = {}
    for key in sorted({"/".join(k.split("/")[:2]) for k in summary}):
        kernels, model = key.split("/")
        mine = [r for r in rows if r["kernels"] == kernels and r["model"] == model]
        reference = [r["eval_loss"] for r in mine if r["variant"] == "reference" and r["eval_loss"] is not None]
        other = [r["eval_loss"] for r in mine if r["variant"] == "reshuffled" and r["eval_loss"] is not None
                 and not r["lost"]]
        if len(reference) < 2 or not other:
            continue
        cells = {k: c for k, c in summary.items() if k.startswith(key + "/") and not k.endswith("/none")}
        chance = chance_to_pass(reference, other, ratios=[c["seeds_all"]["ratio"] for c in cells.values()])
        as_far = chance.pop("as_far")
        # How surprising each fault cell is for such a recovery: its median this far from 1 or farther, its count
        # inside the spread this low or lower.
        each = {k.split("/")[-1]: {"median_as_far": as_far.get(c["seeds_all"]["ratio"]),
                                   "as_few_inside": as_few_inside(c["seeds_all"])} for k, c in cells.items()}
        out[key] = dict(chance, fault_cells=len(cells), expected_passing=chance["both"] * len(cells),
                        guard_passing=sum(not criteria(k, c) for k, c in cells.items()), cells=each)
    return out


def _least(c: Dict[str, Any], what: str) -> Tuple[Optional[float], str]:
    """The smallest of one chance over a model's fault cells, and the cells that have it."""
    values = {name: cell[what] for name, cell in c["cells"].items() if cell[what] is not None}
    if not values:
        return None, "-"
    least = min(values.values())
    return least, ", ".join(name for name, v in values.items() if v == least)


def chance_lines(found: Dict[str, Any]) -> List[str]:
    """:func:`chances` as the report prints it."""
    lines = ["A recovery as good as the reference's own (its runs and the reshuffled ones pooled, split at random): "
             "the chance it passes each quality criterion"]
    for key, c in found.items():
        lines.append(f"  {key}: median within 5% {c['median']:.2f}, 90% inside the spread {c['spread']:.2f} "
                     f"(exactly {c['spread_exact']:.3f} for any distribution), both {c['both']:.2f}: "
                     f"{c['expected_passing']:.1f} of its {c['fault_cells']} fault cells on average; the guard "
                     f"passes {c['guard_passing']}")
        (median, m_where), (count, c_where) = _least(c, "median_as_far"), _least(c, "as_few_inside")
        lines.append(f"    the guard's cells, the least likely for such a recovery: a median as far or farther "
                     f"{_fmt(median, 2)} ({m_where}); a count inside as low or lower {_fmt(count, 2)} ({c_where})")
    if found:
        expected = sum(c["expected_passing"] for c in found.values())
        every = math.prod(c["both"] ** c["fault_cells"] for c in found.values())
        lines.append(f"  in all: {expected:.1f} of {sum(c['fault_cells'] for c in found.values())} fault cells on "
                     f"average, every one of them with chance {every:.1e}; the guard passes "
                     f"{sum(c['guard_passing'] for c in found.values())}")
    return lines


def chance_markdown(found: Dict[str, Any]) -> List[str]:
    """:func:`chances` as docs/zoo.md's table."""
    lines = ["| kernels | model | median within 5% | 90% inside the spread (exactly, any distribution) | both | fault "
             "cells it would pass (on average) | fault cells the guard passes | the guard's cells, least likely for "
             "such a recovery: median as far or farther | count inside as low or lower |", "|" + "---|" * 9]
    for key, c in found.items():
        kernels, model = key.split("/")
        (median, m_where), (count, c_where) = _least(c, "median_as_far"), _least(c, "as_few_inside")
        lines.append(f"| {kernels} | `{model}` | {c['median']:.2f} | {c['spread']:.2f} ({c['spread_exact']:.3f}) | "
                     f"{c['both']:.2f} | {c['expected_passing']:.1f} of {c['fault_cells']} | {c['guard_passing']} | "
                     f"{_fmt(median, 2)} ({m_where}) | {_fmt(count, 2)} ({c_where}) |")
    return lines


def _fmt(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(summary: Dict[str, Any]) -> Tuple[List[str], int]:
    """The printed table and the number of cells that FAIL."""
    lines, failed = [], 0
    for key, cell in summary.items():
        fails = criteria(key, cell)
        failed += bool(fails)
        lines.append(f"{key}: {'PASS' if not fails else 'FAIL: ' + '; '.join(fails)}")
        lines.append(f"  unguarded lost {cell['unguarded_lost']}/{cell['unguarded_runs']}, guarded lost "
                     f"{cell['guarded_lost']}/{cell['guarded_runs']}, false stops {len(cell['false_stops'])}, "
                     f"classes {cell['classes'] or '-'}, quarantined right/wrong {cell['quarantine_right']}/"
                     f"{cell['quarantine_wrong']}, incidents where nothing planted {cell['incidents_unplanted']} "
                     f"(records that only observe: {cell.get('observations_unplanted', 0)}), "
                     f"iterations lost {cell['iters_lost']}")
        for name in ("0-9", "10-19", "all"):
            c = cell.get(f"seeds_{name}")
            if c:
                lines.append(f"  seeds {name:<5}: guarded median {_fmt(c['guarded_median'])} / reference median "
                             f"{_fmt(c['reference_median'])} = {_fmt(c['ratio'])}; inside the reference's spread "
                             f"[{_fmt(c['reference_min'])}, {_fmt(c['reference_max'])}]: {c['inside_spread']}/"
                             f"{c['seeds']} (below it: {c.get('below_spread', 0)})" + as_few_note(c))
        for variant, (what, _) in FLOORS.items():
            floor = cell.get(f"{variant}_all")
            if floor:
                misses = quality(floor, variant)
                lines.append(f"  {what}: median ratio {_fmt(floor['ratio'])}, inside the spread "
                             f"{floor['inside_spread']}/{floor['seeds']} (below it: {floor['below_spread']})"
                             + (f": fails {'; '.join(misses)}" if misses else ": meets the quality criteria"))
        for stop in cell["false_stops"][:3]:
            lines.append(f"  stop seed {stop['seed']}: {stop['error']}: {stop['message'][:160]}")
        for wrong in cell["wrong_class"][:3]:
            lines.append(f"  class seed {wrong['seed']}: {wrong['why'][:160]}")
    return lines, failed


def markdown(summary: Dict[str, Any]) -> List[str]:
    """The summary as docs/zoo.md's table: one row per kernel set, model and scenario."""
    lines = ["| model | scenario | unguarded lost | guarded lost | false stops | classes (records) | quarantined "
             "right/wrong | guarded / reference medians, seeds 0-9 | 10-19 | 0-19 | inside the reference's spread (of "
             "them outside on the better side) | the reference in another order (data faults: and without the planted "
             "sample), 0-19: median ratio, inside | "
             "criteria |", "|" + "---|" * 13]
    for key, cell in summary.items():
        _, model, scenario = key.split("/")
        fails = criteria(key, cell)
        ratios = [_fmt((cell.get(f"seeds_{n}") or {}).get("ratio")) for n in ("0-9", "10-19", "all")]
        total = cell["seeds_all"]
        classes = ", ".join(f"{c} {n}" for c, n in sorted(cell["classes"].items())) or "-"
        floors = {variant: (label, cell[f"{variant}_all"]) for variant, (_, label) in FLOORS.items()
                  if f"{variant}_all" in cell}
        shown = "; ".join(f"{label}{_fmt(f['ratio'])}, {f['inside_spread']}/{f['seeds']}"
                          + (" (misses it too)" if quality(f, variant) else "")
                          for variant, (label, f) in floors.items()) or "-"
        unguarded = "-" if scenario == "none" else f"{cell['unguarded_lost']}/{cell['unguarded_runs']}"
        lines.append(
            f"| {model} | {scenario} | {unguarded} | {cell['guarded_lost']}/{cell['guarded_runs']} "
            f"| {len(cell['false_stops'])} | {classes} | {cell['quarantine_right']}/{cell['quarantine_wrong']} | "
            f"{' | '.join(ratios)} | {total['inside_spread']}/{total['seeds']} ({total['below_spread']} below) | "
            f"{shown} | {'PASS' if not fails else '; '.join(fails)} |")
    return lines


def _child(a: argparse.Namespace, kernels: str) -> List[Dict[str, Any]]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if kernels == "default":
        env["ATEN_CPU_CAPABILITY"] = "default"
    else:
        env.pop("ATEN_CPU_CAPABILITY", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--seeds", a.seeds, "--models", a.models,
           "--scenarios", a.scenarios, "--guard-kwargs", json.dumps(a.guard_kwargs)]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return [dict(r, kernels=kernels) for r in json.loads(done.stdout.strip().splitlines()[-1])]


#: What names one run: a later ``--rows`` file's run replaces an earlier one's with the same.
RUN_KEY = ("kernels", "model", "scenario", "variant", "seed")


def merged(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """The raw rows of earlier ``--out`` files, one per run: where two files hold the same run (:data:`RUN_KEY`: a
    cell re-run on newer code, or a reference every file made), the later file's is kept, so a summary never counts a
    run twice."""
    by_key: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for row in json.load(f)["rows"]:
                by_key[tuple(row.get(k) for k in RUN_KEY)] = row
    return list(by_key.values())


def main(argv: Optional[List[str]] = None) -> int:
    from petr_stability.testing.zoo import MODELS, SCENARIOS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0-19", help="e.g. 0-19, 0,3,5 or 0-2,7")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--kernels", default="native,default", help="native, default, or both")
    p.add_argument("--guard-kwargs", type=json.loads, default={}, help="JSON object of guard settings")
    p.add_argument("--out", default=None, help="JSON file for the raw rows and the summary")
    p.add_argument("--rows", nargs="+", default=None, metavar="JSON",
                   help="summarize the raw rows of earlier --out files (merged: e.g. one per kernel set) instead of "
                        "running")
    p.add_argument("--markdown", action="store_true", help="print the summary as docs/zoo.md's table too")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: this kernel set, rows on stdout
    a = p.parse_args(argv)
    try:
        seeds = parse_seeds(a.seeds)
        models = _names(a.models, MODELS, "model")
        scenarios = _names(a.scenarios, SCENARIOS, "scenario")
        kernel_sets = _names(a.kernels, ("native", "default"), "kernel set")
    except ValueError as exc:
        p.error(str(exc))
    if not isinstance(a.guard_kwargs, dict):
        p.error(f"--guard-kwargs must be a JSON object, got {a.guard_kwargs!r}")
    if a.one:
        print(json.dumps(one_kernel_set(models, scenarios, seeds, a.guard_kwargs)))
        return 0
    t0 = time.perf_counter()
    if a.rows:
        rows = merged(a.rows)
        seeds = sorted({r["seed"] for r in rows})
        models = [m for m in models if any(r["model"] == m for r in rows)]
        scenarios = [s for s in scenarios if any(r["scenario"] == s for r in rows)]
        kernel_sets = sorted({r["kernels"] for r in rows})
    else:
        rows = [r for kernels in kernel_sets for r in _child(a, kernels)]
    summary = summarize(rows)
    lines, failed = report(summary)
    print("\n".join(lines))
    print(f"{len(summary) - failed} PASS, {failed} FAIL of {len(summary)}; {len(rows)} runs, "
          f"wall {time.perf_counter() - t0:.0f}s")
    found = chances(rows, summary)
    print("\n".join(chance_lines(found)))
    if a.markdown:
        print("\n".join(markdown(summary)))
        print("\n".join(chance_markdown(found)))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(dumps({"argv": argv if argv is not None else sys.argv[1:], "seeds": seeds, "models": models,
                           "scenarios": scenarios, "kernels": kernel_sets, "guard_kwargs": a.guard_kwargs,
                           "summary": summary, "criteria": {k: criteria(k, c) for k, c in summary.items()},
                           "chances": found}, rows))
    return 0


def dumps(head: Dict[str, Any], rows: List[Dict[str, Any]]) -> str:
    """``head`` indented, then ``"rows"``: one run per line, compact (1000 runs indented were 2.3 MB; a line per run
    keeps a file diff-able and under a megabyte or two)."""
    text = json.dumps(head, indent=1)
    body = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in rows)
    return text[:-2] + ',\n "rows": [\n' + body + "\n ]\n}\n"


if __name__ == "__main__":
    sys.exit(main())
