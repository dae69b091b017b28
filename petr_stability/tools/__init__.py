"""Command-line tools: the demo, the run report, the config patcher and the pre-flight check (see
:mod:`petr_stability_cli`), and the two errors a tool reports in one line with their exit status."""
import importlib.util
from typing import Dict

__all__ = ["UsageError", "MissingDependency", "require"]


class UsageError(ValueError):
    """Arguments that do not go together, or an argument of the wrong kind: exit status 2, as argparse's own."""

    exit_status = 2


class MissingDependency(RuntimeError):
    """A subcommand needs a package that is not installed: exit status 1, the message says what to install."""

    exit_status = 1


def require(command: str, modules: Dict[str, str]) -> None:
    """Raises :class:`MissingDependency` naming every module of ``modules`` that is not installed.

    Found without importing anything (``importlib.util.find_spec``).

    Args:
        command: the subcommand, for the message (``'demo'``).
        modules: top-level module name -> what the subcommand needs it for, and how to install it.
    """
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        names = ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "") + missing[-1]
        raise MissingDependency(f"{command} needs {names}, not installed here; "
                                + "; ".join(f"{name} ({modules[name]})" for name in missing))
