"""``petr-stability demo``: the argparse main over :func:`petr_stability.demo.run.run_demo`."""
from typing import Any

from . import require

__all__ = ["main", "NEEDS"]

#: What the demo needs beyond torch, checked before its first run (its plot comes last, after every run).
NEEDS = {
    "mmengine": "its runner: pip install 'petr_stability[mmengine]'",
    "mmcv": "mmcv's transformer bricks, of PETR's decoder: pip install mmcv-lite, or your own mmcv build (never "
            "both: they are one package, mmcv)",
    "matplotlib": "its plot, demo.png: pip install 'petr_stability[plot]'",
}


def main(args: Any) -> int:
    """Entry point of ``petr-stability demo`` (``args`` from :mod:`petr_stability_cli`)."""
    require("demo", NEEDS)
    from ..demo.run import SCENARIOS, run_demo

    scenario = getattr(args, "scenario", "all")
    scenarios = None if scenario in (None, "all") else [scenario]
    if scenarios and scenarios[0] not in SCENARIOS:
        raise ValueError(f"--scenario must be one of {list(SCENARIOS)} or 'all', got {scenario!r}")
    run_demo(args.work_dir, iters=args.iters, quick=args.quick, scenarios=scenarios)
    return 0
