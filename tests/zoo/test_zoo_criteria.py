"""benchmarks/zoo.py's criteria and what a recovery as good as the reference's own would score on them."""
import importlib.util
import itertools
import math
import os
import random

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("zoo_bench", os.path.join(HERE, "..", "..", "benchmarks", "zoo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inside_counts(n, m):
    """Every arrangement of n reference and m other runs by rank, and how many of the others lie inside the
    reference's min-max in each: what :func:`spread_chance` counts without enumerating."""
    counts = []
    for where in itertools.combinations(range(n + m), n):
        lo, hi = min(where), max(where)
        counts.append(sum(1 for i in range(n + m) if i not in where and lo < i < hi))
    return counts


@pytest.mark.parametrize("n,m", [(2, 3), (4, 3), (5, 6)])
def test_the_spread_chance_is_the_share_of_rank_arrangements(bench, n, m):
    counts = _inside_counts(n, m)
    for need in range(0, m + 2):
        share = sum(c >= need for c in counts) / len(counts)
        assert bench.spread_chance(n, m, need) == pytest.approx(share)


def test_eighteen_of_twenty_inside_is_a_coin_weighted_seven_to_three_for_a_perfect_recovery(bench):
    assert bench.spread_chance(20, 20, 18) == pytest.approx(0.6975, abs=5e-4)
    rng = random.Random(1)  # and any distribution gives it: a heavy-tailed one drawn here
    draws, hits = 4000, 0
    for _ in range(draws):
        ref = [rng.lognormvariate(0, 2) for _ in range(20)]
        hits += sum(min(ref) <= rng.lognormvariate(0, 2) <= max(ref) for _ in range(20)) >= 18
    assert hits / draws == pytest.approx(0.6975, abs=0.03)
    with pytest.raises(ValueError, match="reference_runs=1"):
        bench.spread_chance(1, 20, 18)


def test_the_chance_to_pass_reads_how_far_a_model_lands_from_itself(bench):
    rng = random.Random(0)
    tight = bench.chance_to_pass([1 + rng.gauss(0, 1e-3) for _ in range(20)],
                                 [1 + rng.gauss(0, 1e-3) for _ in range(20)], draws=400)
    assert tight["median"] == 1.0
    assert tight["spread"] == pytest.approx(tight["spread_exact"], abs=0.08)
    wide = bench.chance_to_pass([rng.lognormvariate(0, 1) for _ in range(20)],
                                [rng.lognormvariate(0, 1) for _ in range(20)], draws=400)
    assert wide["median"] < 0.5
    assert wide["both"] <= min(wide["median"], wide["spread"])
    with pytest.raises(ValueError, match="2 reference runs"):
        bench.chance_to_pass([1.0], [1.0])
    # How surprising a guarded median is: as far from 1 as the splits' own (1.0) always, far beyond them never.
    far = bench.chance_to_pass([1 + rng.gauss(0, 1e-2) for _ in range(20)], [1 + rng.gauss(0, 1e-2) for _ in range(20)],
                               draws=400, ratios=[1.0, 1.002, 1.5, 1 / 1.5])["as_far"]
    assert far[1.0] == 1.0 and far[1.5] == far[1 / 1.5] == 0.0 and 0.0 < far[1.002] < 1.0


def test_chances_count_the_fault_cells_a_perfect_recovery_would_pass_beside_the_guards(bench):
    rng = random.Random(3)
    rows = []
    for seed in range(20):
        for variant in ("reference", "reshuffled"):
            rows.append({"kernels": "native", "model": "m", "scenario": "none", "variant": variant, "seed": seed,
                         "eval_loss": 1 + rng.gauss(0, 1e-3), "lost": False})
    cells = {"native/m/none": None, "native/m/a": None, "native/m/b": None}
    summary = {}
    for key in cells:
        ratio = 1.0 if not key.endswith("/b") else 2.0
        total = {"ratio": ratio, "inside_spread": 20 if ratio == 1.0 else 0, "seeds": 20, "reference_runs": 20}
        summary[key] = {"unguarded_lost": 20, "unguarded_runs": 20, "false_stops": [], "incidents_unplanted": 0,
                        "wrong_class": [], "guarded_lost": 0, "seeds_all": total}
    found = bench.chances(rows, summary)["native/m"]
    assert found["fault_cells"] == 2 and found["guard_passing"] == 1
    assert found["expected_passing"] == pytest.approx(2 * found["both"])
    assert math.isclose(found["spread_exact"], bench.spread_chance(20, 20, 18))
    assert any("guard passes 1" in line for line in bench.chance_lines(bench.chances(rows, summary)))
    # Per fault cell: the guarded median (ratio 2 on these tight runs: never a perfect recovery's) and the count.
    none_inside = 1 - bench.spread_chance(20, 20, 1)
    assert found["cells"]["b"] == {"median_as_far": 0.0, "as_few_inside": pytest.approx(none_inside)}
    assert found["cells"]["a"]["median_as_far"] == 1.0 and found["cells"]["a"]["as_few_inside"] == pytest.approx(1.0)
    assert "| 0.00 (b) |" in bench.chance_markdown({"native/m": found})[-1]


def test_how_surprising_a_count_inside_the_spread_is_for_a_perfect_recovery(bench):
    cmp = {"reference_runs": 20, "seeds": 20}
    assert bench.as_few_inside(dict(cmp, inside_spread=20)) == pytest.approx(1.0)
    assert bench.as_few_inside(dict(cmp, inside_spread=17)) == pytest.approx(0.3025, abs=5e-4)
    assert bench.as_few_inside(dict(cmp, inside_spread=15)) == pytest.approx(0.0909, abs=5e-4)
    assert bench.as_few_inside(dict(cmp, inside_spread=17)) == pytest.approx(1 - bench.spread_chance(20, 20, 18))
    assert bench.as_few_inside(dict(cmp, reference_runs=1, inside_spread=1)) is None


def test_rows_merged_from_several_files_count_each_run_once_the_later_file_winning(bench, tmp_path):
    import json

    def row(variant, seed, loss):
        return {"kernels": "native", "model": "m", "scenario": "x", "variant": variant, "seed": seed,
                "eval_loss": loss}

    older, newer = tmp_path / "older.json", tmp_path / "newer.json"
    older.write_text(json.dumps({"rows": [row("reference", 0, 1.0), row("guarded", 0, 3.0), row("guarded", 1, 2.0)]}))
    newer.write_text(json.dumps({"rows": [row("reference", 0, 1.0), row("guarded", 0, 1.5)]}))
    rows = bench.merged([str(older), str(newer)])
    assert sorted((r["variant"], r["seed"], r["eval_loss"]) for r in rows) == [
        ("guarded", 0, 1.5), ("guarded", 1, 2.0), ("reference", 0, 1.0)]
