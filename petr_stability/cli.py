"""The ``petr-stability`` command: ``demo``, ``report WORK_DIR``, ``patch-config CONFIG -o OUT``, ``check CONFIG``."""
import argparse
import sys
from typing import List, Optional

from . import __version__

__all__ = ["build_parser", "main"]

_DESCRIPTION = ("Keeps fp16 runs of PETR-family 3D detectors alive (NanGuardHook) and works on their configs: "
                "demo (the guard against a real divergence), report (a run's incidents), patch-config (the known "
                "manual fix written into a config), check (a config's known fp16 hazards, before training).")


def _add_demo(sub: "argparse._SubParsersAction") -> None:
    demo = sub.add_parser("demo", help="fp16 runs into a real divergence: unguarded, the known manual fix "
                          "(transformer dropout 0, max_norm 1), guarded (about 1.5 min on 2 CPU cores)")
    demo.add_argument("--work-dir", default="work_dirs/demo",
                      help="where the runs (<work-dir>/<scenario>/<run>/), demo.png and summary.json go")
    demo.add_argument("--scenario", default="all", choices=["all", "dynamics", "data_burst"],
                      help="dynamics (a too-high lr, nothing planted), data_burst (corrupted frames) or all "
                      "(default)")
    demo.add_argument("--iters", type=int, default=None,
                      help="iterations per run (>= 24; default 100 dynamics, 60 data_burst; --quick 24)")
    demo.add_argument("--quick", action="store_true", help="24 iterations per run (the test's size)")


def _add_config_tools(sub: "argparse._SubParsersAction") -> None:
    patch = sub.add_parser("patch-config", help="write the known manual fix (transformer dropout 0, max_norm 1) "
                                                "into a config")
    patch.add_argument("config", help="an MMEngine or MMCV 1.x Python config (.py)")
    patch.add_argument("-o", "--out", default=None, help="the patched, self-contained config to write")
    patch.add_argument("--in-place", action="store_true",
                       help="overwrite CONFIG itself (with or without -o CONFIG); the file as it was is kept as "
                            "CONFIG.bak, or CONFIG.bak.1, .2, ... where that exists (a backup is never overwritten)")
    patch.add_argument("--max-norm", type=float, default=1.0,
                       help="clipping bound: max_norm becomes min(current, this) (default 1)")

    check = sub.add_parser("check", help="name the known fp16 hazards of a config before training (pre-flight)")
    check.add_argument("config", help="an MMEngine or MMCV 1.x Python config (.py)")
    check.add_argument("--gpus", type=int, default=None,
                       help="GPUs the run will use (default: unknown, the learning-rate check is skipped)")
    check.add_argument("--batch-per-gpu", type=int, default=None,
                       help="per-GPU batch (default: the config's own: data.samples_per_gpu for MMCV 1.x, "
                            "train_dataloader.batch_size for MMEngine)")
    check.add_argument("--strict", action="store_true", help="exit 1 when any warning is found")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="petr-stability", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    report = sub.add_parser("report", help="summarize a run's incidents and plot its timeline")
    report.add_argument("work_dir", help="the run's work dir, its nan_guard_incidents.jsonl, or a dir of several "
                                         "runs (each reported on its own)")
    report.add_argument("-o", "--out", default=None,
                        help="PNG path (default <run>/nan_guard_report.png; one run only)")
    _add_config_tools(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Runs one subcommand; returns the exit status (2 for a bad argument or input, or no config reader)."""
    args = build_parser().parse_args(argv)
    # Each tool is imported only when its subcommand runs: --version and --help import none of them.
    try:
        if args.command == "demo":
            from .tools import demo as tool
        elif args.command == "report":
            from .tools import report as tool
        elif args.command == "check":
            from .tools import preflight as tool
        else:
            from .tools import patch_config as tool
        return tool.main(args)
    except (ValueError, TypeError, OSError) as exc:  # OSError: FileNotFoundError, a directory, no permission
        print(f"petr-stability {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        from .configfix.load import NoConfigLoaderError

        if not isinstance(exc, NoConfigLoaderError):
            raise
        print(f"petr-stability {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
