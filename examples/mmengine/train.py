"""Trains an MMEngine config as OpenMMLab's ``tools/train.py`` does: ``Config.fromfile`` + ``Runner.from_cfg``.

    python examples/mmengine/train.py examples/mmengine/config.py [--work-dir DIR] [--bad-sample I]
                                      [--cfg-options KEY=VALUE ...]

``Config.fromfile`` is what imports ``custom_imports`` (so ``NanGuardHook`` is registered before the runner looks
it up) and ``Runner.from_cfg`` takes the config's keys the runner knows. ``Runner(**cfg)`` fails on
``custom_imports`` (an unexpected keyword), and ``Runner(custom_hooks=[dict(type='NanGuardHook')])`` without
``import petr_stability`` fails with "NanGuardHook is not in the mmengine::hook registry".
"""
import argparse
import os
import os.path as osp
from typing import List, Optional

import torch
from mmengine.config import Config, DictAction
from mmengine.runner import Runner

INCIDENT_FILE = "nan_guard_incidents.jsonl"  # petr_stability.INCIDENT_FILE; named here to report it


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The arguments of mmdet3d 1.x's ``tools/train.py`` this example needs, plus ``--bad-sample``."""
    parser = argparse.ArgumentParser(description="Train a model from an MMEngine config (NanGuardHook example)")
    parser.add_argument("config", help="train config file path")
    parser.add_argument("--work-dir", help="the dir to save logs, checkpoints and the guard's incident log")
    parser.add_argument("--bad-sample", type=int, default=None, metavar="I",
                        help="make sample I of the toy dataset a corrupt image (NaN pixels) to see the guard at work")
    parser.add_argument("--cfg-options", nargs="+", action=DictAction,
                        help="override settings of the config, e.g. train_cfg.max_epochs=2")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Builds the runner from the config, trains, and says where the guard's records are."""
    args = parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ:
        # The toy model is tiny: more threads only wait on each other. On a busy 2-core machine one thread ran the
        # example in 8 s, two in 55 s. A real model sets its threads as usual (OMP_NUM_THREADS).
        torch.set_num_threads(1)
    cfg = Config.fromfile(args.config)  # imports custom_imports: petr_stability registers NanGuardHook here
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.bad_sample is not None:
        cfg.train_dataloader.dataset.bad_sample = args.bad_sample
    # Work dir: the command line, then the config, then ./work_dirs/<config name> (tools/train.py's order).
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get("work_dir", None) is None:
        cfg.work_dir = osp.join("./work_dirs", osp.splitext(osp.basename(args.config))[0])

    runner = Runner.from_cfg(cfg)
    runner.train()

    log = osp.join(cfg.work_dir, INCIDENT_FILE)
    if osp.exists(log):
        with open(log, encoding="utf-8") as f:
            count = sum(1 for line in f if line.strip())
        print(f"NanGuard example: {count} incident record(s) in {log}; "
              f"'petr-stability report {cfg.work_dir}' summarises them")
    else:
        print(f"NanGuard example: no incident; the run in {cfg.work_dir} was healthy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
