"""One rank of a distributed MMCV 1.x run (MMDistributedDataParallel, IterBasedRunner) with NanGuardHook (2 CPU
processes over gloo, or one per GPU over NCCL with MMCV's own Fp16OptimizerHook); writes its result as JSON."""
import os
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "mmcv1"))
sys.path.insert(0, os.path.join(HERE, "..", "common"))

from worker_common import (  # noqa: E402
    Extras,
    PoisonPasses,
    finish,
    init_process_group,
    parse_args,
    shared_scenarios,
    train,
    work_dir,
    write_older_checkpoint,
)

SCENARIOS = shared_scenarios(disk_checkpoint=dict(interval=10, by_epoch=False))


def main() -> None:
    args = parse_args(SCENARIOS, "MMCV's Fp16OptimizerHook")
    rank = init_process_group(args.cuda)
    from harness import build_runner, guard_hook
    from mmcv.parallel import MMDistributedDataParallel
    from mmcv.runner import Hook, iter_based_runner
    from torch.utils.data import DataLoader, DistributedSampler

    class PassesHook(Hook):
        def __init__(self, passes: PoisonPasses) -> None:
            self.passes = passes

        def before_train_iter(self, runner):
            self.passes.before_iter(runner.iter, runner.model.module)

    class PlanHook(Hook):  # after OptimizerHook (ABOVE_NORMAL, registered first), before the guard (NORMAL)
        def __init__(self, plan) -> None:
            self.plan = plan

        def after_train_iter(self, runner):
            self.plan.after_step(runner.iter, runner.model.module)

    iter_based_runner.time = types.SimpleNamespace(sleep=lambda s: None)  # the runner's 2 s start-up nap
    kwargs = dict(SCENARIOS[args.scenario])
    directory = work_dir(args.out, rank, kwargs)
    extras = Extras(kwargs)
    kwargs.setdefault("n_samples", 32)
    if args.cuda:
        kwargs.update(device="cuda", fp16_type="Fp16OptimizerHook")
    r = build_runner(directory, runner="iter", **kwargs)
    # As mmdet's train_detector does for distributed runs: DDP around the model, a DistributedSampler.
    module = r.model.module if args.cuda else r.model  # (on CUDA the harness put it in MMDataParallel)
    extras.apply(r.loader.dataset.samples, module.net)
    if extras.passes:
        r.register_hook(PassesHook(PoisonPasses(**extras.passes)), priority="NORMAL")
    if extras.plan:
        r.register_hook(PlanHook(extras.plan), priority="ABOVE_NORMAL")
    if extras.older_run:
        write_older_checkpoint(directory, module, guard_state_in_meta=True)
    r.model = MMDistributedDataParallel(module, device_ids=[torch.cuda.current_device()] if args.cuda else None,
                                        broadcast_buffers=False)
    dataset = r.loader.dataset
    r.loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False))
    result = train(lambda: r.run([r.loader], [("train", 1)]))
    hook = next(h for h in r.hooks if hasattr(h, "clip_grads"))
    finish(args.out, result, r, r.model.module, guard_hook(r).guard, getattr(hook, "loss_scaler", None),
           (hook.grad_clip or {}).get("max_norm"), optimizer_hook=type(hook).__name__)


if __name__ == "__main__":
    main()
