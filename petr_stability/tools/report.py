"""``petr-stability report WORK_DIR``: the argparse main over :mod:`petr_stability.reporting`."""
import os
from typing import Any

from ..core.records import INCIDENT_FILE
from ..reporting import find_runs, is_run_log, report_run
from . import UsageError

__all__ = ["main"]


def main(args: Any) -> int:
    """Entry point of ``petr-stability report`` (``args`` from :mod:`petr_stability_cli`)."""
    if os.path.isfile(args.work_dir) and not is_run_log(args.work_dir):
        raise UsageError(f"{args.work_dir} is not a run's log (nan_guard_incidents.jsonl, vis_data/scalars.json "
                         "or *.log.json); give the run's work dir")
    runs = find_runs(args.work_dir)
    if not runs:
        raise FileNotFoundError(f"no {INCIDENT_FILE}, <timestamp>/vis_data/scalars.json or *.log.json under "
                                f"{args.work_dir}")
    if len(runs) > 1 and args.out:
        raise UsageError(f"{args.work_dir} holds {len(runs)} runs ({', '.join(r.root for r in runs)}); -o names one "
                         "PNG: give one run's work dir, or leave -o out to write each run's own")
    if len(runs) > 1:
        print(f"{args.work_dir} holds {len(runs)} runs; each is reported on its own")
    for i, run in enumerate(runs):
        if i:
            print()
        report_run(run, args.out)
    return 0
