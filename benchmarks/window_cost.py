"""The window trace's cost per incident: state poisoned by a sample (BatchNorm's running_var), traced through the
window since the healthy snapshot, on the PETR-shaped model (CPU), as ratios to a training step measured in one run
(docs/benchmarks.md).

    python benchmarks/window_cost.py [--layers 2] [--window 4 16 64] [--repeats 5]
"""
import argparse
import copy
from typing import Callable, Dict, List

import torch
from timing import median_seconds, stack

from petr_stability.core.diagnosis.window import trace_window
from petr_stability.testing.petr_like import build_petr_like, make_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--window", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_petr_like(num_layers=args.layers, num_query=32).train()
    n = 2 * max(args.window)
    data = make_batch(n, num_query=32, seed=0)
    data[-1] = dict(data[-1], inputs=torch.full_like(data[-1]["inputs"], 1e20))  # poisons in the window's last batch
    healthy = copy.deepcopy(net.state_dict())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    good = stack(data[:2])

    def step() -> None:
        loss = sum(net.losses(good["inputs"], good["cls_t"], good["reg_t"]).values())
        opt.zero_grad()
        loss.backward()
        opt.step()

    def forward_for(batch: Dict[str, torch.Tensor]) -> Callable[[], object]:
        return lambda: net.losses(batch["inputs"], batch["cls_t"], batch["reg_t"])

    def rebuild(indices: List[int]) -> Dict[str, torch.Tensor]:
        return stack([data[i] for i in indices])

    step()  # warm-up
    one_step = median_seconds(step, args.repeats)
    print(f"PETR-shaped model, {args.layers} decoder layers, batch 2, CPU, 1 thread, median of {args.repeats}:")
    print(f"  training step {one_step:.3f} s")
    for w in args.window:
        window = [(k + 1, [n - 2 * w + 2 * k, n - 2 * w + 2 * k + 1]) for k in range(w)]
        report = trace_window(net, healthy, window, rebuild, forward_for)
        assert report["found"] and report["blamed"] == [n - 1], report
        took = median_seconds(lambda win=window: trace_window(net, healthy, win, rebuild, forward_for), args.repeats)
        print(f"  window of {w} batches, culprit last: {report['forwards']} forwards, {took:.3f} s = "
              f"{took / one_step:.2f} x a training step ({took / one_step / w:.2f} x per batch of the window)")


if __name__ == "__main__":
    main()
