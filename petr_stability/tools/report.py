"""``petr-stability report WORK_DIR``: the argparse main over :mod:`petr_stability.reporting`."""
from typing import Any

from ..core.records import INCIDENT_FILE
from ..reporting import find_runs, report_run

__all__ = ["main"]


def main(args: Any) -> int:
    """Entry point of ``petr-stability report`` (``args`` from :mod:`petr_stability.cli`)."""
    runs = find_runs(args.work_dir)
    if not runs:
        raise FileNotFoundError(f"no {INCIDENT_FILE}, <timestamp>/vis_data/scalars.json or *.log.json under "
                                f"{args.work_dir}")
    if len(runs) > 1 and args.out:
        raise ValueError(f"{args.work_dir} holds {len(runs)} runs ({', '.join(r.root for r in runs)}); -o names one "
                         "PNG: give one run's work dir, or leave -o out to write each run's own")
    if len(runs) > 1:
        print(f"{args.work_dir} holds {len(runs)} runs; each is reported on its own")
    for i, run in enumerate(runs):
        if i:
            print()
        report_run(run, args.out)
    return 0
