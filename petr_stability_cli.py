"""The ``petr-stability`` command: ``demo``, ``report WORK_DIR``, ``patch-config CONFIG -o OUT``, ``check CONFIG``.

A top-level module beside the ``petr_stability`` package, not inside it: importing anything inside the package runs
``petr_stability/__init__.py``, which imports torch and registers the hooks with the installed runner family (what
``custom_imports=dict(imports=['petr_stability'])`` relies on). Here parsing, ``--help`` and ``--version`` import
argparse only; a subcommand imports its tool (and with it torch) when it runs.

Exit status: 0 success; 1 the command failed (a file missing or unreadable, a config that does not load, no run
under WORK_DIR, a dependency not installed, ``check --strict`` with a warning); 2 a usage error (an unknown flag, a
bad value, arguments that do not go together); 130 interrupted; 141 the reader of standard output went away
(``petr-stability check ... | head``), quietly, as for a program that SIGPIPE ends.
"""
import argparse
import math
import os
import sys
from typing import Callable, List, Optional, Tuple

__all__ = ["__version__", "build_parser", "main", "DEMO_SCENARIOS", "DEMO_MIN_ITERS", "EXIT_OK", "EXIT_FAILURE",
           "EXIT_USAGE", "EXIT_INTERRUPTED", "EXIT_SIGPIPE"]

#: The package's version (``petr_stability.__version__``; tests/cli/test_cli.py holds the two equal).
__version__ = "0.1.0"

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_SIGPIPE = 141  # 128 + SIGPIPE

#: The demo's scenarios and its smallest --iters (``petr_stability.demo.run``: a test holds them equal).
DEMO_SCENARIOS = ("dynamics", "data_burst")
DEMO_MIN_ITERS = 24

#: What to install when a subcommand meets a missing module (its top-level name).
_INSTALL = {
    "torch": "install your torch build first (pip install torch; for CUDA, the command pytorch.org gives)",
    "mmengine": "pip install 'petr_stability[mmengine]' (or pip install mmengine)",
    "mmcv": "pip install mmcv-lite (pure Python), or your own mmcv build; never both (they are one package, mmcv)",
    "matplotlib": "pip install 'petr_stability[plot]' (or pip install matplotlib)",
}

_DESCRIPTION = ("Keeps fp16 runs of PETR-family 3D detectors alive (NanGuardHook) and works on their configs: "
                "demo (the guard against a real divergence), report (a run's incidents), patch-config (the known "
                "manual fix written into a config), check (a config's known fp16 hazards, before training).")
_EPILOG = ("exit status: 0 success, 1 the command failed (a missing file, a config that does not load, a dependency "
           "not installed; check --strict: a warning), 2 a usage error (a bad flag or value)")


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _add_demo(sub: "argparse._SubParsersAction") -> None:
    demo = sub.add_parser("demo", help="fp16 runs into a real divergence: unguarded, the known manual fix "
                          "(transformer dropout 0, max_norm 1), guarded (about 1.5 min on 2 CPU cores)",
                          epilog="needs mmengine, mmcv's transformer bricks (mmcv or mmcv-lite) and matplotlib")
    demo.add_argument("--work-dir", default="work_dirs/demo",
                      help="where the runs (<work-dir>/<scenario>/<run>/), demo.png and summary.json go")
    demo.add_argument("--scenario", default="all", choices=["all", *DEMO_SCENARIOS],
                      help="dynamics (a too-high lr, nothing planted), data_burst (corrupted frames) or all "
                      "(default)")
    demo.add_argument("--iters", type=_int_at_least(DEMO_MIN_ITERS), default=None,
                      help=f"iterations per run (>= {DEMO_MIN_ITERS}; default 100 dynamics, 60 data_burst; "
                           f"--quick {DEMO_MIN_ITERS})")
    demo.add_argument("--quick", action="store_true", help=f"{DEMO_MIN_ITERS} iterations per run (the test's size)")


def _add_report(sub: "argparse._SubParsersAction") -> None:
    report = sub.add_parser("report", help="summarize a run's incidents; a PNG timeline and an HTML page")
    report.add_argument("work_dir", help="the run's work dir, its nan_guard_incidents.jsonl, or a dir of several "
                                         "runs (each reported on its own)")
    report.add_argument("-o", "--out", default=None,
                        help="PNG path (default <run>/nan_guard_report.png; one run only); the HTML page is "
                             "written beside it, with .html for .png")


def _add_config_tools(sub: "argparse._SubParsersAction") -> None:
    patch = sub.add_parser("patch-config", help="write the known manual fix (transformer dropout 0, max_norm 1) "
                                                "into a config")
    patch.add_argument("config", help="an MMEngine or MMCV 1.x Python config (.py)")
    patch.add_argument("-o", "--out", default=None, help="the patched, self-contained config to write")
    patch.add_argument("--in-place", action="store_true",
                       help="overwrite CONFIG itself (with or without -o CONFIG); the file as it was is kept as "
                            "CONFIG.bak, or CONFIG.bak.1, .2, ... where that exists (a backup is never overwritten)")
    patch.add_argument("--max-norm", type=_positive_number, default=1.0,
                       help="clipping bound: max_norm becomes min(current, this) (default 1)")

    check = sub.add_parser("check", help="name the known fp16 hazards of a config before training (pre-flight)")
    check.add_argument("config", help="an MMEngine or MMCV 1.x Python config (.py)")
    check.add_argument("--gpus", type=_int_at_least(1), default=None,
                       help="GPUs the run will use (default: unknown, the learning-rate check is skipped)")
    check.add_argument("--batch-per-gpu", type=_int_at_least(1), default=None,
                       help="per-GPU batch (default: the config's own: data.samples_per_gpu for MMCV 1.x, "
                            "train_dataloader.batch_size for MMEngine)")
    check.add_argument("--strict", action="store_true", help="exit 1 when any warning is found")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (argparse only: building it imports nothing else)."""
    parser = argparse.ArgumentParser(prog="petr-stability", description=_DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_report(sub)
    _add_config_tools(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    # Each tool is imported only when its subcommand runs: parsing, --version and --help import none of them.
    if args.command == "demo":
        from petr_stability.tools import demo as tool
    elif args.command == "report":
        from petr_stability.tools import report as tool
    elif args.command == "check":
        from petr_stability.tools import preflight as tool
    else:
        from petr_stability.tools import patch_config as tool
    return tool.main(args)


def _explain(exc: BaseException) -> Tuple[Optional[int], str]:
    """(exit status, message) for an error the command reports in one line; (None, '') for a bug (traceback)."""
    status = getattr(exc, "exit_status", None)  # petr_stability.tools.UsageError (2), MissingDependency (1)
    if isinstance(status, int):
        return status, str(exc)
    if isinstance(exc, ModuleNotFoundError):
        root = (exc.name or "").split(".")[0]
        if root in _INSTALL:
            return EXIT_FAILURE, f"{root} is not installed ({exc}): {_INSTALL[root]}"
        return None, ""
    if type(exc).__name__ == "NoConfigLoaderError":  # an ImportError that names both config readers
        return EXIT_FAILURE, str(exc)
    if isinstance(exc, (ValueError, TypeError, OSError)):  # OSError: FileNotFoundError, a directory, no permission
        return EXIT_FAILURE, str(exc)
    return None, ""


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (a broken pipe of stdout, not another one)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return False
    import select

    if not hasattr(select, "poll"):
        return True  # no poll() (Windows): a BrokenPipeError is taken as stdout's
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(event & select.POLLERR for _, event in poller.poll(0))


def _quiet_stdout() -> None:
    """Points stdout at /dev/null, so that the interpreter's flush at exit meets no broken pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Optional[List[str]] = None) -> int:
    """Runs one subcommand and returns its exit status (module docstring); --help, --version and a usage error
    found by argparse exit through SystemExit (0, 0, 2)."""
    args = build_parser().parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's flush at exit
        return status
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        _quiet_stdout()
        return EXIT_SIGPIPE
    except KeyboardInterrupt:
        print(f"petr-stability {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        status, message = _explain(exc)
        if status is None:
            raise
        print(f"petr-stability {args.command}: error: {message}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
