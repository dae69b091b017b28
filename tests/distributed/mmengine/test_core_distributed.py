"""core/distributed.py over a real 2-process gloo group: payload broadcast, per-node groups, mismatch handling, the
asynchronous MAX."""
import os

import torch
from launch import run_workers

from petr_stability.core.distributed import fill_tensors, strip_tensors

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common", "payload_worker.py")


def test_strip_and_fill_round_trip_keeps_types_and_shares_nothing():
    w = torch.ones(2, 2)
    state = {"a": [w, (w.sum(), "x")], "n": 3}
    skeleton, tensors = strip_tensors(state)
    assert len(tensors) == 2 and tensors[0] is w
    assert "Tensor" not in repr(skeleton)
    back = fill_tensors(skeleton, [torch.zeros(2, 2), torch.tensor(5.0)])
    assert back["n"] == 3 and isinstance(back["a"][1], tuple) and float(back["a"][1][0]) == 5.0
    assert float(w.sum()) == 4.0  # the source is untouched


def test_payload_broadcast_over_two_ranks(tmp_path):
    (r0, r1), _ = run_workers(WORKER, "all", str(tmp_path), timeout=90)
    assert r0["reduce_max"] == r1["reduce_max"] == [1, 5]
    assert r0["async_max"] == r1["async_max"] == [3, 7] and r0["between"] == r1["between"] == [0, 1]
    assert r1["full"] and r1["known"] and r0["full"] and r0["known"]
    assert r0["node"] == r1["node"] == [0, [0, 1]]
    assert r0["mismatch"] and r1["mismatch"] and "replicated state" in r1["mismatch"]
    assert r0["after"] == r1["after"] == [1]
