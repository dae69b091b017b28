"""mmdet3d 1.4's real ``projects/PETR`` (VoVNet-99, GridMask, the 6-layer decoder with dropout 0.1) at a CPU size,
trained by a real MMEngine ``Runner`` from the project's own config (``tests_optin/petr14_cpu.py`` says what changes
for the CPU). Opt-in: ``MMDET3D_ROOT=<mmdetection3d v1.4.0 clone> make test-mmdet3d-scope``.

The config ships with ``AmpOptimWrapper`` commented out. Switched on (here its CPU twin, whole-forward fp16
autocast), the question of issue 20 is whether PETR trains or overflows, and whether the guard's verdict matches
what a replay of the batch shows. Measured: every step overflows (the dynamic scale halves from 2**16 on every
iteration) because the head's own position-embedding code overflows fp16; the guard's incident, once the scale
passes its floor, is ``forward_overflow`` with ``pts_bbox_head`` in fp32, and from there the run trains. The test
checks that verdict against its own probe of the start weights, without the guard: the input of
``pts_bbox_head.position_encoder`` is non-finite under fp16 autocast and finite with the head run in fp32.
"""
import contextlib
import copy
import os
import sys
from typing import Any, Dict, Iterator

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import petr14_cpu  # noqa: E402

GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)


@pytest.fixture(scope="module")
def root() -> str:
    found = petr14_cpu.petr_root()
    if found is None:
        pytest.skip(petr14_cpu.HOW_TO_RUN)
    petr14_cpu.import_petr(found)
    return found


@contextlib.contextmanager
def _head_in_fp32(head: torch.nn.Module) -> Iterator[None]:
    """The test's own fp32 head (not the guard's): autocast off inside its forward, floating inputs as fp32."""
    forward = head.forward

    def fp32_forward(*args: Any, **kwargs: Any) -> Any:
        def up(x: Any) -> Any:
            if isinstance(x, (list, tuple)):
                return type(x)(up(v) for v in x)
            return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        with torch.autocast("cpu", enabled=False):
            return forward(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})

    head.forward = fp32_forward
    try:
        yield
    finally:
        del head.forward


def _probe(root: str, work_dir: str) -> Dict[str, bool]:
    """Start weights, one batch, fp16 autocast: is ``position_encoder``'s input finite with the head as it is, and
    with the head in fp32? No guard, no training."""
    from mmengine.runner import Runner

    from petr_stability.testing.fp16_conv import fp16_conv_backward_in_fp32

    torch.manual_seed(0)
    runner = Runner.from_cfg(petr14_cpu.petr_config(root, work_dir, amp=True, samples=2, num_query=100))
    model = runner.model
    head = model.pts_bbox_head
    seen = []
    handle = head.position_encoder.register_forward_pre_hook(
        lambda module, args: seen.append(all(bool(torch.isfinite(a).all()) for a in args
                                             if isinstance(a, torch.Tensor))))
    batch = next(iter(runner.train_dataloader))
    finite = {}
    with petr14_cpu.cpu_cuda_calls(), fp16_conv_backward_in_fp32(), torch.no_grad():
        data = model.data_preprocessor(batch, True)
        for name, context in (("as_is", contextlib.nullcontext()), ("head_fp32", _head_in_fp32(head))):
            seen.clear()
            with context, torch.autocast("cpu", dtype=torch.float16):
                model(**copy.deepcopy(data), mode="loss")  # the forward writes into the samples' metainfo
            finite[name] = bool(seen) and all(seen)
    handle.remove()
    return finite


def test_petr_trains_in_fp32_without_an_incident(root, tmp_path):
    out = petr14_cpu.train(petr14_cpu.petr_config(root, str(tmp_path), amp=False, samples=8, guard=GUARD,
                                                  num_query=100))
    assert out["error"] is None and out["weights_finite"]
    assert out["incidents"] == []
    assert [r["iteration"] for r in out["records"]] == list(range(1, 9))
    assert all(r["loss"] is not None and r["loss"] == r["loss"] for r in out["records"])


def test_petr_under_amp_overflows_in_its_head_and_gets_the_head_in_fp32(root, tmp_path):
    probe = _probe(root, str(tmp_path / "probe"))
    # What the replay should find, seen without the guard: the head's own fp16 code breaks, the head in fp32 does not.
    assert probe == {"as_is": False, "head_fp32": True}, probe

    out = petr14_cpu.train(petr14_cpu.petr_config(root, str(tmp_path / "run"), amp=True, samples=30, guard=GUARD,
                                                  num_query=100))
    assert out["error"] is None and out["weights_finite"]
    records = out["records"]
    # Before the incident: every step an overflow, the scale halving from 2**16 down to the guard's floor.
    first = records[:16]
    assert all(r["skipped"] for r in first) and first[0]["scale_before"] == 2.0 ** 16, first
    (incident,) = out["incidents"]
    assert incident["event"] == "divergence" and incident["iteration"] == 17
    assert incident["cause"]["cause"] == "forward_overflow"
    assert incident["cause"]["modules"] == ["pts_bbox_head"]
    assert incident["diagnosis"]["first"]["module"] == "pts_bbox_head.position_encoder"
    assert incident["diagnosis"]["fp32_check"]["fixed_by"] == "pts_bbox_head"
    assert [(a["target"], a["new"]) for a in incident["actions"]] == [("pts_bbox_head", "float32")]
    assert out["fp32"] == ["pts_bbox_head"]
    # After it: the run trains (steps applied, at most the scaler's ordinary first overflows skipped).
    after = records[17:]
    applied = [r for r in after if not r["skipped"]]
    assert len(applied) >= len(after) - 3 and len(applied) >= 10, after
    with open(os.path.join(str(tmp_path / "run"), "nan_guard_patched_config.py")) as f:
        assert "fp32_modules: None -> ['pts_bbox_head']" in f.read()
