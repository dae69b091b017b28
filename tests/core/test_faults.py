"""The fire drill's plan, without a runner: every build-time message, the run-start check of ``param`` (a name the
model lacks, a buffer or a frozen parameter for a gradient fault) and the warning for faults past the last iteration."""
import math
import re

import pytest
import torch
from torch import nn

from petr_stability.core.faults import Fault, FaultPlan, parse_faults


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)
        self.backbone[0].requires_grad_(False)  # a frozen stage, as PETR freezes its backbone's first stages


# ------------------------------------------------------------------ checked when the hook is built
@pytest.mark.parametrize(
    "entry, error, needle",
    [
        (dict(kind="cosmic-ray", iters=[1]), ValueError, "unknown fault kind 'cosmic-ray'; choose from"),
        (dict(kind=3, iters=[1]), ValueError, "unknown fault kind 3"),
        (dict(kind="loss", iters=[0]), ValueError, "fault iters must be a non-empty list of integers >= 1, got [0]"),
        (dict(kind="loss", iters=[]), ValueError, "got []"),
        (dict(kind="loss", iters=-2), ValueError, "got [-2]"),
        (dict(kind="loss", iters=[2.0]), ValueError, "got [2.0]"),
        (dict(kind="loss", iters=[True]), ValueError, "got [True]"),
        (dict(kind="loss", iters="5"), ValueError, "got '5'"),
        (dict(kind="loss", iters=[2], value="lots"), ValueError,
         "fault value must be a number or 'nan'/'inf'/'-inf', got 'lots' (could not convert"),
        (dict(kind="loss", iters=[2], value=None), ValueError,
         "fault value must be a number or 'nan'/'inf'/'-inf', got None"),
        (dict(kind="loss", iters=[2], value=True), ValueError, "got True"),
        (dict(kind="loss", iters=[2], ranks=[-1]), ValueError,
         "fault ranks must be None or a non-empty list of integers >= 0, got [-1]"),
        (dict(kind="loss", iters=[2], ranks=[]), ValueError, "fault ranks must be None or a non-empty list"),
        (dict(kind="loss", iters=[2], ranks="0"), ValueError, "got '0'"),
        (dict(kind="weights", iters=[2], param=7), ValueError,
         "fault param must be a parameter name (str) or None, got 7"),
        (dict(kind="loss", iters=[2], param="head.weight"), ValueError,
         "fault param applies to 'weights' and 'grads' faults only, got param='head.weight' for kind 'loss'"),
        (dict(kind="batch", iters=[2], param="x"), ValueError, "for kind 'batch'"),
        (dict(kind="loss", iter=[2]), ValueError, "unknown fault key(s) ['iter']; a fault takes"),
        (dict(iters=[2]), ValueError, "a fault needs 'kind' and 'iters', got {'iters': [2]}"),
        (dict(kind="loss"), ValueError, "a fault needs 'kind' and 'iters', got {'kind': 'loss'}"),
        ("loss@5", TypeError, "a fault is a dict (or a Fault), got 'loss@5'"),
    ],
)
def test_a_bad_fault_is_refused_at_build_naming_the_value(entry, error, needle):
    with pytest.raises(error, match=re.escape(needle)):
        FaultPlan([entry])


@pytest.mark.parametrize("faults", ["loss", None, 5])
def test_faults_that_are_not_a_list_are_refused(faults):
    with pytest.raises(TypeError, match=re.escape(f"faults must be a list of dicts (or Faults), got {faults!r}")):
        FaultPlan(faults)


def test_good_faults_are_normalized():
    (f,) = parse_faults(dict(kind="grads", iters=4, value="-inf", ranks=1, param="head.bias"))
    assert f.iters == [4] and f.ranks == [1] and f.value == -math.inf and f.param == "head.bias"
    assert math.isnan(parse_faults([dict(kind="loss", iters=[1])])[0].value)
    assert parse_faults([dict(kind="batch", iters=[1], value=1e6)])[0].value == 1e6
    built = Fault("loss", iters=[2])
    assert parse_faults([built]) == [built]  # a Fault passes through


# ------------------------------------------------------------------ checked when the run starts
def test_a_parameter_name_the_model_lacks_is_named_with_close_names():
    plan = FaultPlan([dict(kind="weights", iters=[3], param="head.wieght")])
    with pytest.raises(ValueError) as err:
        plan.check(Net(), max_iters=10)
    msg = str(err.value)
    assert "'head.wieght'" in msg and "weights fault at iters [3]" in msg
    assert "close names: 'head.weight'" in msg


def test_with_no_close_name_a_few_of_the_models_names_are_listed():
    plan = FaultPlan([dict(kind="weights", iters=[3], param="transformer.decoder.layers.0.attn.in_proj_weight")])
    with pytest.raises(ValueError, match=re.escape("the model has 9 names, e.g. 'backbone.0.weight'")):
        plan.check(Net(), max_iters=10)


def test_a_buffer_name_is_fine_for_weights_but_not_for_grads():
    FaultPlan([dict(kind="weights", iters=[3], param="backbone.1.running_var")]).check(Net(), max_iters=10)
    plan = FaultPlan([dict(kind="grads", iters=[3], param="backbone.1.running_var")])
    with pytest.raises(ValueError, match=re.escape(
            "'backbone.1.running_var' is a buffer, not a parameter: a grads fault needs a parameter")):
        plan.check(Net(), max_iters=10)


def test_a_frozen_parameter_is_refused_for_grads():
    plan = FaultPlan([dict(kind="grads", iters=[3], param="backbone.0.weight")])
    with pytest.raises(ValueError, match=re.escape("'backbone.0.weight' does not require grad (frozen)")):
        plan.check(Net(), max_iters=10)


def test_no_trainable_parameter_for_a_fault_without_param():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="the model has no trainable parameter for the grads fault at iters \\[1\\]"):
        FaultPlan([dict(kind="grads", iters=[1])]).check(frozen, max_iters=10)


def test_faults_past_the_last_iteration_are_named_in_one_warning():
    plan = FaultPlan([dict(kind="weights", iters=[5, 12]), dict(kind="loss", iters=[11]),
                      dict(kind="grads", iters=[10])])
    warning = plan.check(Net(), max_iters=10)
    assert warning == ("planned past the run's last iteration 10, these never fire: "
                       "weights fault at iters [12], loss fault at iters [11]")
    assert plan.check(Net(), max_iters=12) is None
    assert plan.check(Net(), max_iters=None) is None  # unknown length: nothing to say


def test_a_fault_checked_before_the_run_still_fires():
    model = Net()
    plan = FaultPlan([dict(kind="weights", iters=[2], param="head.bias")])
    plan.check(model, max_iters=5)
    assert plan.inject(0, 0, model) == []
    (line,) = plan.inject(1, 0, model)
    assert "iter 2" in line and "head.bias" in line and math.isnan(model.head.bias[0].item())
    assert bool(torch.isfinite(model.head.weight).all())
