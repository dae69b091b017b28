"""The counterfactual's cost per incident: a diagnosis with and without the replay of the batch known to be good, on
the PETR-shaped model (CPU), as ratios measured in one run (docs/benchmarks.md).

    python benchmarks/counterfactual_cost.py [--layers 2] [--repeats 7]
"""
import argparse
import copy
import math

import torch
from timing import median_seconds, stack

from petr_stability.core.diagnosis import diagnose_step
from petr_stability.testing.petr_like import build_petr_like, make_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_petr_like(num_layers=args.layers, num_query=32).train()
    bad, good = stack(make_batch(2, num_query=32, seed=0)), stack(make_batch(2, num_query=32, seed=1))
    bad["inputs"][0, :4] = math.nan  # a corrupt image: the failing batch breaks the healthy weights too
    healthy = copy.deepcopy(net.state_dict())

    def failing() -> object:
        return net.losses(bad["inputs"], bad["cls_t"], bad["reg_t"])

    def known_good() -> object:
        return net.losses(good["inputs"], good["cls_t"], good["reg_t"])

    def diagnosis(counterfactual: bool) -> object:
        return diagnose_step(net, failing, healthy_weights=healthy, healthy_from="snapshot", compare="reproduced",
                             good_forward=known_good if counterfactual else None, good_from="the last good batch")

    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step() -> None:
        loss = sum(known_good().values())
        opt.zero_grad()
        loss.backward()
        opt.step()

    diagnosis(True)  # warm-up
    without = median_seconds(lambda: diagnosis(False), args.repeats)
    with_ = median_seconds(lambda: diagnosis(True), args.repeats)
    one_step = median_seconds(step, args.repeats)
    extra = with_ - without
    print(f"PETR-shaped model, {args.layers} decoder layers, batch 2, CPU, 1 thread, median of {args.repeats}:")
    print(f"  training step {one_step:.3f} s; diagnosis {without:.3f} s without the counterfactual, {with_:.3f} s with")
    print(f"  counterfactual: {extra:.3f} s = {extra / with_:.0%} of the diagnosis = {extra / one_step:.2f} x a "
          f"training step (once per incident whose batch breaks the healthy weights; healthy steps: 0)")


if __name__ == "__main__":
    main()
