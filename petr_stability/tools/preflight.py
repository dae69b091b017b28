"""``petr-stability check``: the argparse entry point of the pre-flight check (:mod:`petr_stability.configfix`)."""
from typing import Any

from ..configfix.preflight import check_file, format_findings
from . import UsageError

__all__ = ["main"]


def main(args: Any) -> int:
    """Entry point of ``petr-stability check`` (``args`` from :mod:`petr_stability_cli`)."""
    if not str(args.config).endswith(".py"):
        raise UsageError(f"CONFIG must be a Python config file (.py), got {args.config}")
    try:
        findings = check_file(args.config, world_size=args.gpus, batch_per_gpu=args.batch_per_gpu)
    except (OSError, ImportError, ValueError, TypeError):
        raise  # each names the file or the bad value already (load_config wraps what a config's own code raises)
    except Exception as exc:  # a config is Python: anything else while reading it is a bad input too
        raise ValueError(f"{args.config} could not be loaded: {type(exc).__name__}: {exc}") from exc
    print(format_findings(findings))
    if args.strict and any(f.severity == "warning" for f in findings):
        return 1
    return 0
