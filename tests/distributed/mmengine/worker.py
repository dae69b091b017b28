"""One rank of a distributed MMEngine run with NanGuardHook (2 CPU processes over gloo, or one per GPU over NCCL
with MMEngine's own AmpOptimWrapper); writes its result as JSON for the test."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "mmengine"))
sys.path.insert(0, os.path.join(HERE, "..", "common"))

from worker_common import (  # noqa: E402
    GUARD,
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

SMALL = dict(num_layers=1, num_query=16)

SCENARIOS = dict(
    shared_scenarios(disk_checkpoint=dict(interval=10)),
    # Epoch-based loop, a checkpoint at each epoch end (rank 0 only): NaN weights on rank 1 just before it.
    epoch_save_one_rank=dict(max_iters=None, max_epochs=2, n_samples=32, amp=dict(init_scale=512.0), guard=GUARD,
                             checkpoint=dict(interval=1), faults=[dict(kind="weights", iters=[8], ranks=[1])]),
)


def main() -> None:
    args = parse_args(SCENARIOS, "MMEngine's AmpOptimWrapper")
    rank = init_process_group(args.cuda)
    from harness import build_runner, guard_hook
    from mmengine.hooks import Hook

    class PassesHook(Hook):
        def __init__(self, passes: PoisonPasses) -> None:
            self.passes = passes

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            self.passes.before_iter(runner.iter, getattr(runner.model, "module", runner.model))

    class PlanHook(Hook):  # after the optimizer step (in train_step), before the guard (NORMAL)
        def __init__(self, plan) -> None:
            self.plan = plan

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            self.plan.after_step(runner.iter, getattr(runner.model, "module", runner.model))

    kwargs = dict(SCENARIOS[args.scenario])
    directory = work_dir(args.out, rank, kwargs)
    extras = Extras(kwargs)
    kwargs.setdefault("model_kwargs", SMALL)
    if args.cuda:  # MMEngine's own DDP wrapping (device_ids=[LOCAL_RANK]) and its own AmpOptimWrapper
        kwargs.update(amp_type="AmpOptimWrapper")
    else:
        kwargs.update(cfg=dict(model_wrapper_cfg=dict(type="MMDistributedDataParallel", device_ids=None)))
    runner = build_runner(directory, launcher="pytorch", **kwargs)
    module = getattr(runner.model, "module", runner.model)
    extras.apply(runner._train_dataloader["dataset"].samples, module.net)  # the loader is built by train()
    if extras.passes:
        runner.register_hook(PassesHook(PoisonPasses(**extras.passes)), priority="NORMAL")
    if extras.plan:
        runner.register_hook(PlanHook(extras.plan), priority="ABOVE_NORMAL")
    if extras.older_run:
        write_older_checkpoint(directory, module, guard_state_in_meta=False)
    result = train(runner.train)
    wrapper = runner.optim_wrapper
    finish(args.out, result, runner, getattr(runner.model, "module", runner.model), guard_hook(runner).guard,
           getattr(wrapper, "loss_scaler", None), wrapper.clip_grad_kwargs.get("max_norm"),
           optim_wrapper=type(wrapper).__name__)


if __name__ == "__main__":
    main()
