"""``petr-stability patch-config``: the argparse entry point that writes the known manual fix into a config."""
import os
from typing import Any, Tuple

from ..configfix import ConfigFix, format_changes, load_config, write_patched_config
from . import UsageError

__all__ = ["main"]

#: ``CONFIG.bak``, then ``CONFIG.bak.1``, ``.2``, ...: an --in-place run never overwrites an earlier backup.
_MAX_BACKUPS = 1000


def _backup(config: str) -> str:
    """Copies ``config`` byte for byte to the first free ``CONFIG.bak[.N]``; never overwrites one."""
    with open(config, "rb") as f:
        data = f.read()
    for n in range(_MAX_BACKUPS):
        path = config + ".bak" + (f".{n}" if n else "")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # O_EXCL: a race cannot overwrite
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path
    raise ValueError(f"{config}.bak ... {config}.bak.{_MAX_BACKUPS - 1} all exist; remove old backups first")


def _out_path(args: Any, config: str) -> Tuple[str, bool]:
    """(the file to write, whether that is CONFIG itself)."""
    in_place = bool(getattr(args, "in_place", False))
    out = args.out if args.out is not None else (config if in_place else None)
    if out is None:
        raise UsageError("name the file to write with -o OUT, or pass --in-place to overwrite CONFIG "
                         "(the original is kept as CONFIG.bak, or CONFIG.bak.N where that exists)")
    out = os.path.abspath(out)
    if os.path.isdir(out):
        raise UsageError(f"output {out} is a directory; name the config file to write")
    same = os.path.exists(out) and os.path.samefile(out, config) or out == config
    if same and not in_place:
        raise UsageError(f"-o {out} is CONFIG itself; pass --in-place to overwrite it (the original is kept as "
                         f"{out}.bak, or {out}.bak.N where that exists)")
    return out, same


def main(args: Any) -> int:
    """Entry point of ``petr-stability patch-config`` (``args`` from :mod:`petr_stability_cli`)."""
    config = os.path.abspath(args.config)
    if not config.endswith(".py"):
        raise UsageError(f"CONFIG must be a Python config file (.py), got {args.config}")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"config file {config} does not exist")
    out, same = _out_path(args, config)
    fix = ConfigFix.known_manual_fix(args.max_norm)  # the header says what these arguments asked for
    load_config(config)  # a config that does not load is refused before a backup is made
    backup = _backup(config) if same else None
    result = write_patched_config(config, out, fix, child=False)
    print(f"{fix.describe()}: " + format_changes(result.changes, result.notes, result.family))
    if backup is not None:
        print(f"kept the file as it was before this run in {backup}")
    print(f"written: {out}")
    return 0
