"""Trains an MMCV 1.x config as mmdet 2.x ``tools/train.py`` + ``mmdet.apis.train_detector`` do, on MMCV 1.7 alone.

    python examples/mmcv1/train.py examples/mmcv1/config.py [--work-dir DIR] [--bad-sample I]
                                   [--cfg-options KEY=VALUE ...]

MMCV 1.x has no ``Runner.from_cfg``: the train script builds everything, and this one does it in mmdet's order
(mmdet3d 0.x, PETR and StreamPETR call the same ``train_detector`` or a copy of it). Two of its steps are what
make the README's two config lines work: ``import_modules_from_strings(**cfg['custom_imports'])`` registers
``NanGuardHook`` in ``mmcv.runner.HOOKS``, and the ``custom_hooks`` loop builds it from there with its priority.
A train script that skips either never runs the guard (or fails with "NanGuardHook is not in the hook registry").
"""
import argparse
import os
import os.path as osp
import random
import sys
import time
from typing import Any, List, Optional

import numpy as np
import torch
from mmcv import Config, DictAction, mkdir_or_exist
from mmcv.cnn import MODELS
from mmcv.parallel import MMDataParallel
from mmcv.runner import HOOKS, Fp16OptimizerHook, build_optimizer, build_runner
from mmcv.utils import build_from_cfg, get_logger, import_modules_from_strings
from torch.utils.data import DataLoader

INCIDENT_FILE = "nan_guard_incidents.jsonl"  # petr_stability.INCIDENT_FILE; named here to report it


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The arguments of mmdet 2.x ``tools/train.py`` this example needs, plus ``--bad-sample``."""
    parser = argparse.ArgumentParser(description="Train a model from an MMCV 1.x config (NanGuardHook example)")
    parser.add_argument("config", help="train config file path")
    parser.add_argument("--work-dir", help="the dir to save logs, checkpoints and the guard's incident log")
    parser.add_argument("--bad-sample", type=int, default=None, metavar="I",
                        help="make sample I of the toy dataset a corrupt image (NaN pixels) to see the guard at work")
    parser.add_argument("--cfg-options", nargs="+", action=DictAction,
                        help="override settings of the config, e.g. runner.max_epochs=2")
    return parser.parse_args(argv)


def set_random_seed(seed: int) -> None:
    """mmdet's ``set_random_seed``: Python, NumPy and torch from one seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def train_detector(model: torch.nn.Module, dataset: Any, cfg: Config, logger: Any, timestamp: str,
                   meta: dict) -> Any:
    """mmdet 2.28 ``train_detector`` for one process (no distributed launch, no validation); returns the runner."""
    generator = torch.Generator().manual_seed(cfg.seed)  # mmdet seeds its sampler from cfg.seed too
    data_loader = DataLoader(dataset, batch_size=cfg.data.samples_per_gpu, shuffle=True,
                             num_workers=cfg.data.workers_per_gpu, generator=generator)
    if torch.cuda.is_available():
        model = MMDataParallel(model.cuda(), device_ids=[torch.cuda.current_device()])
    else:
        model = MMDataParallel(model)  # mmdet wraps on the CPU too; the wrapper then leaves the data on the CPU
    optimizer = build_optimizer(model, cfg.optimizer)
    runner = build_runner(cfg.runner, default_args=dict(
        model=model, optimizer=optimizer, work_dir=cfg.work_dir, logger=logger, meta=meta))
    runner.timestamp = timestamp  # the .log and .log.json files share a name, as mmdet's do

    # fp16 = dict(loss_scale=...) in the config turns the optimizer hook into MMCV's Fp16OptimizerHook.
    fp16_cfg = cfg.get("fp16", None)
    if fp16_cfg is not None:
        optimizer_config = Fp16OptimizerHook(**cfg.optimizer_config, **fp16_cfg, distributed=False)
    else:
        optimizer_config = cfg.optimizer_config
    runner.register_training_hooks(cfg.lr_config, optimizer_config, cfg.checkpoint_config, cfg.log_config,
                                   cfg.get("momentum_config", None))
    # User-defined hooks, each built from mmcv.runner.HOOKS with its priority (NORMAL unless the config says).
    # mmdet 2.28 passes custom_hooks_config=cfg.custom_hooks to register_training_hooks, which does the same
    # (megvii PETR's tools/train.py gets there through mmdet3d's train_model); StreamPETR's mmdet_train.py has
    # this very loop.
    for hook_cfg in cfg.get("custom_hooks", None) or []:
        hook_cfg = hook_cfg.copy()
        priority = hook_cfg.pop("priority", "NORMAL")
        runner.register_hook(build_from_cfg(hook_cfg, HOOKS), priority=priority)

    if cfg.resume_from:
        runner.resume(cfg.resume_from)
    elif cfg.load_from:
        runner.load_checkpoint(cfg.load_from)
    runner.run([data_loader], cfg.workflow)
    return runner


def main(argv: Optional[List[str]] = None) -> int:
    """mmdet 2.x ``tools/train.py``: config, imports, work dir, logger, meta, model, dataset, train."""
    args = parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ:
        # The toy model is tiny: more threads only wait on each other. On a busy 2-core machine one thread ran the
        # MMEngine example in 8 s, two in 55 s. A real model sets its threads as usual (OMP_NUM_THREADS).
        torch.set_num_threads(1)
    cfg = Config.fromfile(args.config)
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.bad_sample is not None:
        cfg.data.train.bad_sample = args.bad_sample
    # Registers NanGuardHook (petr_stability) and the toy model; mmdet's tools/train.py does exactly this.
    if cfg.get("custom_imports", None):
        import_modules_from_strings(**cfg["custom_imports"])
    if cfg.get("fp16", None) is not None and not torch.cuda.is_available():
        # Without a GPU MMCV's GradScaler disables itself and auto_fp16 hands the fp32 layers half inputs.
        print("fp16 needs a GPU (MMCV's Fp16OptimizerHook and auto_fp16 are CUDA-only); drop fp16 to train on the CPU",
              file=sys.stderr)
        return 2
    # Work dir: the command line, then the config, then ./work_dirs/<config name> (tools/train.py's order).
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get("work_dir", None) is None:
        cfg.work_dir = osp.join("./work_dirs", osp.splitext(osp.basename(args.config))[0])
    mkdir_or_exist(osp.abspath(cfg.work_dir))
    # The effective config goes into the work dir and into runner.meta, as mmdet's tools/train.py puts it there:
    # the guard reads it from meta to check the run's config and to write nan_guard_patched_config.py beside it.
    cfg.dump(osp.join(cfg.work_dir, osp.basename(args.config)))
    timestamp = time.strftime("%Y%m%d_%H%M%S", time.localtime())
    logger = get_logger("toy_detector", log_file=osp.join(cfg.work_dir, f"{timestamp}.log"),
                        log_level=cfg.log_level)
    meta = dict(config=cfg.pretty_text, seed=cfg.seed, exp_name=osp.basename(args.config))
    logger.info(f"Config:\n{cfg.pretty_text}")
    set_random_seed(cfg.seed)

    from toy_detector import DATASETS  # the dataset registry, as mmdet's tools/train.py imports mmdet.datasets

    model = MODELS.build(cfg.model)  # mmdet: build_detector(cfg.model), the same registry one level down
    model.init_weights()
    dataset = build_from_cfg(cfg.data.train, DATASETS)
    train_detector(model, dataset, cfg, logger, timestamp, meta)

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
