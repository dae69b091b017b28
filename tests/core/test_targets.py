"""Declared targets (issue 40 item 2): a remedy declares what it sets in the optimizer's param groups, absolute or
relative to the configured value; one framework helper applies it after a rollback, on resume and from the next
run's ``carry=``, and never twice (the trap a relative weight-decay remedy met: 0.005 -> 0.0025 on resume)."""
import json

import pytest
import torch
from fake_io import FakeIO

from petr_stability.core.causes import Cause, Classification
from petr_stability.core.config import GuardConfig
from petr_stability.core.port import Payload
from petr_stability.core.recovery.policy import CausePolicy, Remedies
from petr_stability.core.remedies import Outcome, Remedy, Target, When, register_remedy
from petr_stability.core.remedies.registry import REMEDY_TYPES
from petr_stability.core.remedies.targets import CARRY_KEY, Targets


class Decay(Remedy):
    """The docs' relative remedy, in small: the weight decay halved per incident, relative to the config's."""

    name = "decay_t"
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)
    events = (When.AFTER_RESTORE,)
    state = ("scale",)

    def __init__(self, config):
        super().__init__(config)
        self.scale = 1.0

    def apply(self, ctx):
        self.scale *= 0.5
        return Outcome(targets=(Target("weight_decay", self.scale, relative=True),))


class OnlyDynamics(Remedy):
    """The typed protocol: its events are the methods it overrides."""

    name = "only_dyn"
    causes = (Cause.DYNAMICS,)

    def after_restore(self, run, incident):
        return Outcome(targets=(Target("momentum", 0.5),))


@pytest.fixture
def registered():
    for cls in (Decay, OnlyDynamics):
        register_remedy(cls)
    yield
    for cls in (Decay, OnlyDynamics):
        REMEDY_TYPES.pop(cls.name, None)


def _io(weight_decay=0.01):
    io = FakeIO()
    rest = [p for n, p in io.net.named_parameters() if n != "out.bias"]
    io.opt = torch.optim.AdamW([{"params": rest}, {"params": [io.net.out.bias], "weight_decay": 0.0}], lr=1e-3,
                               weight_decay=weight_decay)
    return io


def _groups(io, key="weight_decay"):
    return [g[key] for g in io.opt.param_groups]


def test_a_relative_target_multiplies_the_configured_value_whatever_the_groups_hold_later():
    io, targets = _io(), Targets()
    changes = targets.declare("decay", [Target("weight_decay", 0.5, relative=True)], io)
    assert _groups(io) == [0.005, 0.0] and [(c.target, c.old, c.new) for c in changes] == [
        ("optimizer0.group0.weight_decay", 0.01, 0.005)]  # 0.0 x 0.5 is 0.0: no change, none recorded
    assert targets.enforce(io) == []  # in force: nothing applied twice
    # A resumed run: its state (JSON) and groups that hold the changed value already.
    resumed, state = Targets(), json.loads(json.dumps(targets.state_dict()))
    resumed.load_state_dict(state)
    again = _io(weight_decay=0.005)
    again.opt.param_groups[1]["weight_decay"] = 0.0
    assert resumed.enforce(again) == [] and _groups(again) == [0.005, 0.0]
    # A restore that put back an older group (MMEngine restores param groups): the target again, from the config's.
    io.opt.param_groups[0]["weight_decay"] = 0.01
    assert [c.new for c in targets.enforce(io)] == [0.005]
    # Declared again (the next incident): relative to the configured value still, not to the live one.
    targets.declare("decay", [Target("weight_decay", 0.25, relative=True)], io)
    assert _groups(io) == [0.0025, 0.0]
    # The next run: carried without the configured values; its own config's value is the base.
    carried = json.loads(json.dumps(targets.carried("decay")))
    assert carried == {"weight_decay": {"value": 0.25, "relative": True}}
    following, fresh = Targets(), _io(weight_decay=0.02)
    following.take_carried("decay", carried, fresh)
    assert _groups(fresh) == [0.005, 0.0]


def test_an_absolute_target_sets_a_tuple_element_and_skips_groups_without_the_key():
    io, targets = _io(), Targets()
    io.opt.param_groups[1].pop("betas")
    changes = targets.declare("beta2", [Target("betas[1]", 0.95)], io)
    assert io.opt.param_groups[0]["betas"] == (0.9, 0.95) and "betas" not in io.opt.param_groups[1]
    assert [(c.target, c.old, c.new) for c in changes] == [("optimizer0.group0.betas[1]", 0.999, 0.95)]
    assert targets.summary() == {"beta2": {"betas[1]": "0.95"}}


@pytest.mark.parametrize("key, value, words", [("weight decay", 0.5, "Target.key must be"),
                                               ("betas[x]", 0.5, "Target.key must be"),
                                               ("lr", float("nan"), "Target.value must be a finite number")])
def test_a_bad_target_is_refused_naming_it(key, value, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        Target(key, value)


def test_a_remedy_s_targets_act_once_per_incident_survive_resume_and_rollback_and_carry(registered):
    config = GuardConfig(remedies=[dict(type="decay_t")])
    io, policy = _io(), CausePolicy(config)
    payload = Payload(io.capture(), 0, 0, tags=policy.tags())  # a restore point taken before the remedy acted
    for incident, want in ((1, 0.005), (2, 0.0025)):
        c = Classification(Cause.DYNAMICS, "fine on the healthy weights")
        io.restore(payload)  # the rollback put back the older groups (as MMEngine's restore does)
        c, changes, _ = policy.after_restore(c, io, payload, incident)
        assert _groups(io)[0] == pytest.approx(want) and policy.remedy("decay_t").scale == want * 100
    # A rollback on its own (no new incident's remedy): the restore's older groups are brought back to the target.
    io.opt.param_groups[0]["weight_decay"] = 0.01
    assert [c.new for c in policy.remedies.targets.enforce(io)] == [0.0025]
    state = json.loads(json.dumps(policy.state_dict()))
    assert state["targets"]["decay_t"]["weight_decay"]["base"] == {"0.0": 0.01, "0.1": 0.0}
    # Resumed: the checkpoint's groups hold 0.0025; start() applies nothing again.
    resumed, again = CausePolicy(config), _io(weight_decay=0.0025)
    again.opt.param_groups[1]["weight_decay"] = 0.0
    resumed.load_state_dict(state)
    assert [c for c in resumed.start(again) if "weight_decay" in c.target] == [] and _groups(again)[0] == 0.0025
    # The next run, from the patched config's carry=: the factor and the target, on that run's configured value.
    entry = policy.remedies.config_entries(io)["decay_t"]
    assert entry.carry == {"scale": 0.25, CARRY_KEY: {"weight_decay": {"value": 0.25, "relative": True}}}
    following = CausePolicy(GuardConfig(remedies=[dict(type="decay_t")], carry={"decay_t": dict(entry.carry)}))
    fresh = _io()
    following.start(fresh)
    assert _groups(fresh)[0] == 0.0025 and following.remedy("decay_t").scale == 0.25
    assert not following.remedies.idle(following.remedy("decay_t"))


def test_a_remedy_declaring_dynamics_alone_is_not_called_for_an_unknown_incident_even_on_a_rung(registered):
    assert OnlyDynamics.events == (When.AFTER_RESTORE,)  # read from the method it overrides
    config = GuardConfig(remedies=[dict(type="only_dyn")], ladder=[["clip", "dropout", "only_dyn"], ["lr"]])
    remedies = Remedies(config)
    io = _io()
    for cause, called in ((Cause.UNKNOWN, []), (Cause.DYNAMICS, ["only_dyn"])):
        ctx = remedies.context(io, When.AFTER_RESTORE, cls=Classification(cause, ""))
        assert [r.name for r in remedies.takers(When.AFTER_RESTORE, ctx, ["only_dyn"])] == called


def test_the_typed_protocol_gives_each_event_s_method_what_is_valid_there_and_refuses_events_that_disagree():
    seen = []

    class Typed(Remedy):
        name = "typed_t"
        causes = (Cause.DATA,)

        def on_healthy(self, run, step):
            seen.append(("healthy", step.iteration, step.spikes))

        def on_restored(self, run, incident, restored):
            seen.append(("restored", incident.number, incident.cls.cause, dict(restored)))

        def on_spent(self, run, incident):
            seen.append(("spent", incident.samples))

    register_remedy(Typed)
    try:
        assert Typed.events == (When.HEALTHY, When.RESTORED, When.SPENT)
        remedies, io = Remedies(GuardConfig(remedies=[dict(type="typed_t")])), _io()
        for event, fields in ((When.HEALTHY, dict(iteration=7, extra={"spikes": "monitor"})),
                              (When.RESTORED, dict(incident=2, cls=Classification(Cause.DATA, ""), restored={"a": 1})),
                              (When.SPENT, dict(samples=[{"index": 3}], cls=Classification(Cause.DATA, "")))):
            remedies.fire(event, remedies.context(io, event, **fields))
        assert seen == [("healthy", 7, "monitor"), ("restored", 2, Cause.DATA, {"a": 1}), ("spent", ({"index": 3},))]
    finally:
        REMEDY_TYPES.pop("typed_t", None)

    class Disagrees(Remedy):
        name = "disagrees_t"
        events = (When.START,)

        def after_rollback(self, run):
            return None

    with pytest.raises(TypeError, match=r"Disagrees.events \['start'\] differ from the events whose method it "
                                        r"overrides \['after rollback'\]"):
        register_remedy(Disagrees)
    assert "disagrees_t" not in REMEDY_TYPES


class StartsWarm(Remedy):
    """A typed remedy whose ``on_start`` declares a target from its carried state (the next run's start)."""

    name = "starts_warm"
    state = ("decay",)

    def __init__(self, config):
        super().__init__(config)
        self.decay = None

    def on_start(self, run):
        return Outcome(targets=(Target("weight_decay", self.decay),)) if self.decay is not None else None


def test_a_carried_remedys_on_start_targets_are_kept_in_force_in_the_next_run():
    # The next run gives a remedy its carried state, then fires start: a target its on_start declares is applied
    # and held like any other (before, the carried start kept only the changes and dropped the targets).
    register_remedy(StartsWarm)
    try:
        io = _io()
        remedies = Remedies(GuardConfig(remedies=[dict(type="starts_warm")], carry={"starts_warm": {"decay": 0.002}}))
        changes = remedies.reapply({"starts_warm": {"decay": 0.002}}, io, lambda *a: None)
        assert [g["weight_decay"] for g in io.opt.param_groups] == [0.002, 0.002] and changes
        assert remedies.targets.by_remedy["starts_warm"]["weight_decay"]["value"] == 0.002
        io.opt.param_groups[0]["weight_decay"] = 0.01  # a restore that put the configured groups back
        assert remedies.enforce(io) and io.opt.param_groups[0]["weight_decay"] == 0.002
    finally:
        REMEDY_TYPES.pop(StartsWarm.name, None)
