"""``petr-stability demo``: the argparse main over :func:`petr_stability.demo.run.run_demo`."""
from typing import Any

from ..demo.run import SCENARIOS, run_demo

__all__ = ["main"]


def main(args: Any) -> int:
    """Entry point of ``petr-stability demo`` (``args`` from :mod:`petr_stability.cli`)."""
    scenario = getattr(args, "scenario", "all")
    scenarios = None if scenario in (None, "all") else [scenario]
    if scenarios and scenarios[0] not in SCENARIOS:
        raise ValueError(f"--scenario must be one of {list(SCENARIOS)} or 'all', got {scenario!r}")
    run_demo(args.work_dir, iters=args.iters, quick=args.quick, scenarios=scenarios)
    return 0
