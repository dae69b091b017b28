"""The remedies as vertical slices: each built-in remedy through the events it takes against a plain-torch IO, the
generic state pass and its checkpoint layout, the lists read from the registered types (``remedies=``, the ladder,
the cause table's remedies, the settings), and a remedy added in this one file through ``register_remedy``."""
import math

import pytest
import torch
from fake_io import FakeIO

from petr_stability.core.causes import Cause, Classification
from petr_stability.core.config import REMEDIES, GuardConfig, settings
from petr_stability.core.recovery.policy import CausePolicy, Remedies
from petr_stability.core.remedies import Change, ConfigEntry, Outcome, Remedy, When, register_remedy
from petr_stability.core.remedies.adaptive_clip import AdaptiveClip
from petr_stability.core.remedies.clip import ClipRemedy
from petr_stability.core.remedies.dropout import DropoutRemedy
from petr_stability.core.remedies.fp32 import Fp32Remedy
from petr_stability.core.remedies.lr import LrBackoff
from petr_stability.core.remedies.moments import MomentsReset
from petr_stability.core.remedies.quarantine import Quarantine
from petr_stability.core.remedies.registry import LADDER, REMEDY_TYPES, serving
from petr_stability.core.remedies.rollback import Rollback
from petr_stability.core.remedies.scale import ScaleDynamic
from petr_stability.core.remedies.temporal import TemporalReset
from petr_stability.core.validate import Setting, is_number


def _fire(remedies, event, io, names=None, **fields):
    return remedies.fire(event, remedies.context(io, event, **fields), names)


def _round_trip(remedies, config):
    again = Remedies(config)
    again.load_state_dict(remedies.state_dict())
    assert again.state_dict() == remedies.state_dict()
    return again


@pytest.fixture
def registered():
    """Registers remedies for one test and removes them afterwards (the registry is process-wide)."""
    added = []

    def add(cls):
        added.append(cls.name)
        return register_remedy(cls)

    yield add
    for name in added:
        REMEDY_TYPES.pop(name, None)


def test_the_lists_are_read_from_the_registered_types():
    assert REMEDIES == ("clip", "dropout", "rollback", "scale", "lr", "moments", "quarantine", "fp32", "temporal")
    assert [r.name for r in LADDER] == ["the known manual fix (transformer dropout 0, max_norm 1)",
                                        "learning rate backoff", "optimizer moments reset"]
    assert [r.remedies for r in LADDER] == [("clip", "dropout"), ("lr",), ("moments",)]
    assert [r.repeat for r in LADDER] == [False, True, False]
    assert serving(Cause.DATA) == ("rollback", "quarantine") and serving(Cause.FORWARD_OVERFLOW) == ("rollback", "fp32")
    assert serving(Cause.DYNAMICS) == ("clip", "dropout", "lr", "moments", "rollback")
    assert serving(Cause.STRUCTURAL) == ()
    names = [s.name for s in settings()]
    assert len(names) == len(set(names)) and {"lr_backoff", "quarantine_fraction", "exploded_ratio"} <= set(names)


def test_the_ladder_text_follows_the_settings():
    assert CausePolicy(GuardConfig(lr_backoff=0.25)).ladder_text() == (
        "the known manual fix (transformer dropout 0, max_norm 1), then learning rate x 0.25 (schedules too) (again "
        "at each incident while it can act: down to lr_min_factor), then optimizer moments reset")
    custom = CausePolicy(GuardConfig(ladder=[["lr"], ["clip", "dropout"]], lr_backoff=0.5))
    assert custom.ladder_text() == ("learning rate x 0.5 (schedules too) (again at each incident while it can act: "
                                    "down to lr_min_factor), then the known manual fix (transformer dropout 0, "
                                    "max_norm 1)")


def test_the_state_keeps_the_checkpoint_layout_and_idle_remedies_are_never_called(monkeypatch):
    remedies = Remedies(GuardConfig())
    state = remedies.state_dict()
    # Issue 40: one layout for every remedy, built-in or not: its state under remedies.<name>.
    assert set(state) == {"policy", "remedies", "remedies_layout"} and state["policy"] == {}
    assert {name: set(part) for name, part in state["remedies"].items()} == {
        "clip": {"clip"}, "dropout": {"dropout_zeroed"}, "scale": {"scale_made_dynamic"},
        "lr": {"lr_factor", "lr_rewarms", "lr_rewarm_wait", "lr_healthy_run", "lr_last_healthy"},
        "quarantine": {"skip", "sightings", "refused_samples", "identities"}, "fp32": {"fp32"}}
    for cls in REMEDY_TYPES.values():  # an idle remedy is read from its declarations alone
        monkeypatch.setattr(cls, "summary", lambda self, io: pytest.fail(f"{self.name}.summary called"))
    summary = remedies.summary(FakeIO())
    assert summary == {"max_norm": None, "dropout_zeroed": False, "scale_made_dynamic": False, "lr_factor": 1.0,
                       "quarantined": [], "refused": [], "bad_samples": [], "fp32_modules": {}}
    assert remedies.config_entries(FakeIO()) == {}


def test_a_checkpoint_of_the_older_layout_loads_into_each_remedys_own_entry():
    # Before issue 40 the built-ins kept their state at the guard state's top level (clip, dropout, scale) or in its
    # policy section (lr, quarantine, fp32); a run resumed from such a checkpoint keeps every value.
    old = {"recoveries": 2, "clip": {"clip.max_norm": 1.0}, "dropout_zeroed": True, "scale_made_dynamic": False,
           "policy": {"lr_factor": 0.25, "fp32": ["out"], "skip": {"indices": {"7": {"iteration": 3}}},
                      "history": {}, "rung": 1}}
    remedies = Remedies(GuardConfig())
    remedies.load_state_dict(old)
    assert remedies.get("clip").clip == {"clip.max_norm": 1.0} and remedies.get("dropout").dropout_zeroed
    assert remedies.get("lr").lr_factor == 0.25 and remedies.get("fp32").fp32 == ["out"]
    assert remedies.get("quarantine").skip["indices"] == {"7": {"iteration": 3}}
    state = remedies.state_dict()
    assert state["remedies"]["lr"]["lr_factor"] == 0.25 and state["remedies"]["clip"]["clip"] == {"clip.max_norm": 1.0}
    # A checkpoint of the new layout never reads the old places: a remedy with no entry there keeps its defaults.
    fresh = Remedies(GuardConfig())
    fresh.load_state_dict(dict(state, remedies={"lr": {"lr_factor": 0.5}}, policy={"fp32": ["out"]}))
    assert fresh.get("lr").lr_factor == 0.5 and fresh.get("fp32").fp32 == []


def test_the_built_ins_fire_in_their_declared_order_and_one_registered_with_an_order_takes_its_place(registered):
    assert [r.order for r in REMEDY_TYPES.values()] == sorted(r.order for r in REMEDY_TYPES.values())

    class Early(Remedy):
        name = "early"
        order = 15  # between clip (10) and dropout (20)

    registered(Early)
    assert list(REMEDY_TYPES)[:3] == ["clip", "early", "dropout"]
    assert [r.name for r in Remedies(GuardConfig()).all][:3] == ["clip", "early", "dropout"]

    class Unordered(Remedy):
        name = "unordered"
        order = "late"

    with pytest.raises(TypeError, match="Unordered.order must be an int"):
        registered(Unordered)


def test_clip_tightens_at_a_divergence_and_again_at_start_after_a_resume():
    config, io = GuardConfig(), FakeIO()
    remedies = Remedies(config)
    c = Classification(Cause.DYNAMICS, "fine on the healthy weights")
    out = _fire(remedies, When.BEFORE_RESTORE, io, ["clip"], incident=1, cls=c)
    assert [x.as_dict() for x in out.changes] == [Change("clip.max_norm", 35.0, 1.0).as_dict()]
    clip = remedies.get("clip")
    assert isinstance(clip, ClipRemedy) and clip.in_effect(remedies.context(io, When.BEFORE_RESTORE, incident=1))
    assert remedies.summary(io)["max_norm"] == 1.0
    assert remedies.config_entries(io)["clip"] == ConfigEntry(fix={"max_norm": 1.0})
    fresh = FakeIO()
    _fire(_round_trip(remedies, config), When.START, fresh)
    assert fresh.clip["max_norm"] == 1.0


def test_clip_follows_its_schedule():
    clip = ClipRemedy(GuardConfig(max_norm_schedule=[10, 3, 1]))
    assert [clip.target(i) for i in (1, 2, 3, 9)] == [10.0, 3.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"max_norm_schedule must not be empty, got \[\]"):
        GuardConfig(max_norm_schedule=[])


def test_dropout_zeroes_once_and_again_on_resume():
    config, io = GuardConfig(dropout_scope="all"), FakeIO()
    remedies = Remedies(config)
    out = _fire(remedies, When.BEFORE_RESTORE, io, cls=Classification(Cause.DYNAMICS, "x"), names=["dropout"])
    dropout = remedies.get("dropout")
    assert isinstance(dropout, DropoutRemedy) and out.changes and dropout.dropout_zeroed
    assert dropout.in_effect(remedies.context(io, When.BEFORE_RESTORE))
    fresh = FakeIO()
    _fire(_round_trip(remedies, config), When.START, fresh)
    assert all(m.p == 0 for m in fresh.net.modules() if isinstance(m, torch.nn.Dropout))


def test_lr_backoff_lasts_and_a_restore_tag_brings_an_older_state_back():
    config, io = GuardConfig(lr_backoff=0.5), FakeIO()
    remedies = Remedies(config)
    tags_before = remedies.tags()
    _fire(remedies, When.AFTER_RESTORE, io, cls=Classification(Cause.DYNAMICS, "x"), names=["lr"])
    lr = remedies.get("lr")
    assert isinstance(lr, LrBackoff) and lr.lr_factor == 0.5 and io.opt.param_groups[0]["lr"] == 0.005
    assert remedies.tags() == {"lr.lr_factor": 0.5} and tags_before == {"lr.lr_factor": 1.0}
    io.opt.param_groups[0]["lr"] = 0.01  # a restore put back the optimizer of a state from before the backoff
    out = remedies.restored(io, tags_before)
    assert io.opt.param_groups[0]["lr"] == 0.005 and out.changes
    assert remedies.restored(io, remedies.tags()).changes == ()  # the same factor: never called
    assert remedies.tags_in({"remedies": {"lr": {"lr_factor": 0.25}}}) == {"lr.lr_factor": 0.25}
    assert remedies.tags_in({"policy": {"lr_factor": 0.25}}) == {"lr.lr_factor": 0.25}  # a checkpoint's older layout
    assert remedies.tags_in(None) == {"lr.lr_factor": 1.0}
    assert _round_trip(remedies, config).get("lr").lr_factor == 0.5


def test_lr_rewarm_gives_the_rate_back_after_healthy_steps_and_waits_longer_once_trouble_returned():
    config, io = GuardConfig(lr_backoff=0.5, lr_rewarm=3), FakeIO()
    sched = torch.optim.lr_scheduler.StepLR(io.opt, step_size=100)
    io.lr_schedulers = lambda: [sched]
    remedies = Remedies(config)
    lr = remedies.get("lr")
    dynamics = Classification(Cause.DYNAMICS, "x")

    def healthy(iteration):
        return _fire(remedies, When.HEALTHY, io, iteration=iteration).changes

    assert healthy(1) == () and lr.lr_healthy_run == 0  # nothing backed off: nothing to give back, nothing counted
    for _ in range(2):
        _fire(remedies, When.AFTER_RESTORE, io, cls=dynamics, names=["lr"])
    assert lr.lr_factor == 0.25 and io.opt.param_groups[0]["lr"] == pytest.approx(0.0025)
    assert healthy(10) == () and healthy(11) == ()
    assert healthy(7) == () and lr.lr_healthy_run == 1  # the iteration went back (a rollback): counted afresh
    assert healthy(8) == () and lr.lr_factor == 0.25
    changes = healthy(9)  # the third healthy step in a row: one step back up, the schedule with it
    assert lr.lr_factor == 0.5 and io.opt.param_groups[0]["lr"] == pytest.approx(0.005)
    assert {c.target for c in changes} >= {"optimizer0.group0.lr", "StepLR.base_lrs"}
    assert sched.base_lrs == [pytest.approx(0.005)]
    assert lr.lr_rewarms == [{"iteration": 9, "from": 0.25, "to": 0.5}]
    assert any("re-warmed after 3 healthy iterations" in m and "0.25 -> 0.5" in m for _, m in io.logs)
    # Trouble returns: backed off again, and the next re-warm waits twice as long.
    _fire(remedies, When.AFTER_RESTORE, io, cls=dynamics, names=["lr"])
    assert lr.lr_factor == 0.25 and lr.lr_rewarm_wait == 6
    assert all(healthy(i) == () for i in range(20, 25)) and lr.lr_factor == 0.25
    assert healthy(25) and lr.lr_factor == 0.5
    assert all(healthy(i) == () for i in range(26, 31)) and healthy(31) and lr.lr_factor == 1.0
    assert io.opt.param_groups[0]["lr"] == pytest.approx(0.01) and sched.base_lrs == [pytest.approx(0.01)]
    assert healthy(32) == () and lr.lr_healthy_run == 0  # back at the schedule's own rate: never above it
    again = _round_trip(remedies, config).get("lr")
    assert again.lr_rewarms == lr.lr_rewarms and again.lr_rewarm_wait == 6 and again.lr_factor == 1.0
    assert remedies.summary(io)["lr_rewarms"][-1] == {"iteration": 31, "from": 0.5, "to": 1.0}
    assert remedies.config_entries(io).get("lr", ConfigEntry()).fix == {}  # given back: the next run needs nothing
    # Off by default: a backoff lasts the run.
    off, io2 = Remedies(GuardConfig()), FakeIO()
    _fire(off, When.AFTER_RESTORE, io2, cls=dynamics, names=["lr"])
    assert all(_fire(off, When.HEALTHY, io2, iteration=i).changes == () for i in range(1, 500))
    assert off.get("lr").lr_factor == 0.125
    # A factor that does not divide back exactly (0.3 * 0.3 / 0.3 / 0.3) still lands on the schedule's own rate.
    odd, io3 = Remedies(GuardConfig(lr_backoff=0.3, lr_rewarm=1)), FakeIO()
    for _ in range(2):
        _fire(odd, When.AFTER_RESTORE, io3, cls=dynamics, names=["lr"])
    for i in range(1, 4):
        _fire(odd, When.HEALTHY, io3, iteration=i)
    assert [r["to"] for r in odd.get("lr").lr_rewarms] == [pytest.approx(0.3), 1.0]
    assert io3.opt.param_groups[0]["lr"] == pytest.approx(0.01) and odd.config_entries(io3)["lr"].fix == {}


def test_moments_named_before_the_restore_and_cleared_after():
    io = FakeIO()
    io.opt = torch.optim.Adam(io.net.parameters())
    io.train_step()
    remedies = Remedies(GuardConfig())
    c = Classification(Cause.DYNAMICS, "x")
    assert _fire(remedies, When.BEFORE_RESTORE, io, ["moments"], cls=c).changes == ()
    assert isinstance(remedies.get("moments"), MomentsReset)
    assert _fire(remedies, When.AFTER_RESTORE, io, ["moments"], cls=c).changes and not any(io.opt.state.values())


def test_scale_dynamic_needs_a_static_scale_and_resumes():
    class StaticIO(FakeIO):
        resumed = False

        def make_scale_dynamic(self):
            return Change("loss_scale", "static 512", "dynamic")

        def restore_scale_mode(self):
            self.resumed = True

    config = GuardConfig()
    remedies = Remedies(config)
    scale = remedies.get("scale")
    assert isinstance(scale, ScaleDynamic)
    assert _fire(remedies, When.STALLED, FakeIO()).changes == () and not scale.scale_made_dynamic
    assert _fire(remedies, When.STALLED, StaticIO()).changes and scale.scale_made_dynamic
    io = StaticIO()
    _fire(_round_trip(remedies, config), When.START, io)
    assert io.resumed
    off = Remedies(GuardConfig(remedies=["clip"]))
    assert _fire(off, When.STALLED, StaticIO()).changes == ()


def test_quarantine_takes_samples_evidence_names_and_those_named_at_two_skipped_steps():
    config, io = GuardConfig(quarantine_fraction=1.0), FakeIO()
    io.dataset_size = lambda: 10
    remedies = Remedies(config)
    quarantine = remedies.get("quarantine")
    assert isinstance(quarantine, Quarantine)
    exclude = _fire(remedies, When.ATTACH, io).exclude
    assert exclude == [quarantine.skip_list] and quarantine.skip is None  # empty: idle, nothing saved
    c = Classification(Cause.DATA, "bad batch", signals={"iteration": 3})
    out = _fire(remedies, When.BEFORE_RESTORE, io, cls=c, samples=[{"index": 4}], iteration=3)
    assert out.changes and list(quarantine.skip_list) == [4] and out.samples.quarantined == ({"index": 4},)
    assert out.applied_to(c).signals["quarantined"] == [{"index": 4}]  # as the record shows it
    assert _fire(remedies, When.SKIPPED, io, samples=[{"index": 7}], epoch=0).changes == ()
    out = _fire(remedies, When.SKIPPED, io, samples=[{"index": 7}], epoch=1, iteration=9)
    assert out.changes and out.samples.recurring == ({"index": 7},) and out.samples.quarantined == ({"index": 7},)
    assert out.samples.reason == "made steps go wrong in epochs [0, 1]" and out.samples.bad_data is None
    again = _round_trip(remedies, config)
    _fire(again, When.ATTACH, io)
    assert list(again.get("quarantine").skip_list) == [4, 7]
    assert again.summary(io)["bad_samples"] == [4, 7]
    assert again.config_entries(io)["quarantine"] == ConfigEntry(fix={"quarantine": [4, 7]})


def test_quarantine_with_nothing_named_quarantines_nothing():
    config, io = GuardConfig(quarantine_fraction=1.0), FakeIO()
    io.dataset_size = lambda: 10
    remedies = Remedies(config)
    _fire(remedies, When.ATTACH, io)
    c = Classification(Cause.DATA, "the batch breaks the healthy weights too")
    out = _fire(remedies, When.BEFORE_RESTORE, io, cls=c, samples=[])
    assert out.changes == () and "nothing quarantined" in out.applied_to(c).evidence


def test_fp32_runs_a_module_in_fp32_once_then_structural():
    config, io = GuardConfig(), FakeIO()
    remedies = Remedies(config)
    c = Classification(Cause.FORWARD_OVERFLOW, "overflow", modules=["out"])
    out = _fire(remedies, When.BEFORE_RESTORE, io, cls=c)
    assert out.changes and remedies.summary(io)["fp32_modules"] == {"out": "Linear"}
    again = _fire(remedies, When.BEFORE_RESTORE, io, cls=c)
    assert again.changes == () and again.applied_to(c).cause == Cause.STRUCTURAL
    assert c.cause == Cause.FORWARD_OVERFLOW  # classes are immutable: the outcome gives a new one
    assert isinstance(remedies.get("fp32"), Fp32Remedy) and _round_trip(remedies, config).get("fp32").fp32 == ["out"]


def test_lr_assists_a_forward_overflow_only_where_the_weights_grew_into_it():
    # The replay's signal decides: an overflow the healthy weights show too (the batch's, every batch's) changes no
    # rate; one the weights grew into gets the fp32 module and the learning rate x lr_backoff; lr_on_overflow=False
    # keeps the module alone. Without the fp32 remedy the class is not served (the ladder takes it instead).
    grew = Classification(Cause.FORWARD_OVERFLOW, "overflow", modules=["out"], signals={"weights_grew": True})
    every = grew.with_signals(weights_grew=False)
    for config, cls, factor in ((GuardConfig(), grew, 0.5), (GuardConfig(), every, 1.0),
                                (GuardConfig(lr_on_overflow=False), grew, 1.0),
                                (GuardConfig(), Classification(Cause.FORWARD_OVERFLOW, "no healthy weights"), 1.0)):
        remedies, io = Remedies(config), FakeIO()
        _fire(remedies, When.AFTER_RESTORE, io, cls=cls)
        assert remedies.get("lr").lr_factor == factor and io.opt.param_groups[0]["lr"] == 0.01 * factor, cls
    assert "lr" not in serving(Cause.FORWARD_OVERFLOW)
    no_fp32 = CausePolicy(GuardConfig(remedies=[r for r in REMEDIES if r != "fp32"]))
    assert not no_fp32.enabled(Cause.FORWARD_OVERFLOW)  # the rollback alone is no answer (it was, before)
    c, changes = no_fp32.before_restore(grew, FakeIO(), [], 1)
    assert c.cause == Cause.DYNAMICS and "the fp32 remedy is off: the ladder instead" in c.evidence and changes
    action = CausePolicy(GuardConfig(overflow_lr_backoff=0.25)).action_text(Cause.FORWARD_OVERFLOW)
    assert "grew into the overflow" in action and "x 0.25" in action
    # The ladder's own factor is lr_backoff (0.125: the model zoo's), the overflow's overflow_lr_backoff (0.5).
    remedies, io = Remedies(GuardConfig()), FakeIO()
    _fire(remedies, When.AFTER_RESTORE, io, cls=Classification(Cause.DYNAMICS, "x"), names=["lr"])
    assert remedies.get("lr").lr_factor == 0.125


def test_temporal_reset_and_rollback_switch():
    class Memory(torch.nn.Module):
        calls = 0

        def reset_memory(self):
            Memory.calls += 1

    io = FakeIO()
    io.net.memory = Memory()
    remedies = Remedies(GuardConfig())
    assert isinstance(remedies.get("temporal"), TemporalReset)
    assert _fire(remedies, When.AFTER_ROLLBACK, io).signals == {"temporal_reset": ["memory"]} and Memory.calls == 1
    assert _fire(Remedies(GuardConfig(remedies=["clip"])), When.AFTER_ROLLBACK, io).signals == {}
    c = Classification(Cause.DATA, "x")
    assert isinstance(remedies.get("rollback"), Rollback)
    assert CausePolicy(GuardConfig()).rolls_back(c, io)
    assert not CausePolicy(GuardConfig(remedies=["clip"])).rolls_back(c, io)
    assert not CausePolicy(GuardConfig()).rolls_back(Classification(Cause.STRUCTURAL, "x"), io)


def test_adaptive_clip_follows_the_monitor_never_above_its_base():
    class Ready:
        ready = True

        @staticmethod
        def clip_bound(base):
            return min(base, 2.0)

    config, io = GuardConfig(adaptive_clip=True), FakeIO()
    remedies = Remedies(config)
    adaptive = remedies.get("adaptive_clip")
    assert isinstance(adaptive, AdaptiveClip) and adaptive.name not in REMEDIES
    _fire(remedies, When.START, io)
    _fire(remedies, When.HEALTHY, io, extra={"spikes": Ready()})
    assert io.clip["max_norm"] == 2.0
    _fire(remedies, When.BEFORE_RESTORE, io, ["clip"], incident=1, cls=Classification(Cause.DYNAMICS, "x"))
    _fire(remedies, When.HANDLED, io)
    assert adaptive.base == {"clip.max_norm": 1.0} and not math.isnan(io.clip["max_norm"])
    assert _fire(Remedies(GuardConfig()), When.HEALTHY, FakeIO(), extra={"spikes": Ready()}).changes == ()


# ---------------------------------------------------------------------- a remedy of one's own, in this file
class Beta2(Remedy):
    """Lowers Adam's beta2 on a dynamics incident, as the OPT-175B logbook did by hand (its own setting, state,
    summary and patched-config entry; re-applied at start)."""

    name = "beta2"
    label = "Adam beta2 to {beta2_target:g}"
    causes = (Cause.DYNAMICS, Cause.UNKNOWN)
    events = (When.START, When.BEFORE_RESTORE)
    settings = (Setting("beta2_target", 0.95, is_number(0.0, 1.0), "the beta2 a dynamics incident sets."),)
    state = ("beta2",)
    idle = {"beta2": None}

    def __init__(self, config):
        super().__init__(config)
        self.beta2 = None

    def match(self, ctx):
        return ctx.event != When.START or self.beta2 is not None

    def apply(self, ctx):
        target = self.beta2 if ctx.event == When.START else self.config.beta2_target
        changes = []
        for i, opt in enumerate(ctx.io.optimizers()):
            for j, group in enumerate(opt.param_groups):
                if "betas" in group and group["betas"][1] != target:
                    changes.append(Change(f"optimizer{i}.group{j}.betas[1]", group["betas"][1], target))
                    group["betas"] = (group["betas"][0], target)
        self.beta2 = target
        return Outcome(tuple(changes), evidence=f"; Adam beta2 {target:g}")


def test_a_remedy_registered_from_outside_acts_on_its_cause_saves_its_state_and_carries_it(registered):
    registered(Beta2)
    with pytest.raises(ValueError, match="beta2_target must be a number in \\(0, 1\\), got 2"):
        GuardConfig(beta2_target=2)
    config = GuardConfig(remedies=list(REMEDIES) + ["beta2"], ladder=[["clip", "dropout", "beta2"], ["lr"]])
    io = FakeIO()
    io.opt = torch.optim.Adam(io.net.parameters())
    policy = CausePolicy(config)
    c, changes = policy.before_restore(Classification(Cause.DYNAMICS, "fine on the healthy weights"), io, [], 1)
    assert io.opt.param_groups[0]["betas"][1] == 0.95 and c.evidence.endswith("; Adam beta2 0.95")
    assert {"optimizer0.group0.betas[1]", "clip.max_norm"} <= {x.target for x in changes}
    assert "Adam beta2 to 0.95" in policy.action_text(Cause.DYNAMICS)
    state = policy.state_dict()
    assert state["remedies"]["beta2"] == {"beta2": 0.95}  # where the built-ins' state sits too
    assert policy.summary(io)["beta2"] == 0.95
    entry = policy.remedies.config_entries(io)["beta2"]
    assert entry == ConfigEntry(carry={"beta2": 0.95})
    # The next run: from its checkpoint state (resume), or from the patched config's carry=.
    resumed, fresh = CausePolicy(config), FakeIO()
    fresh.opt = torch.optim.Adam(fresh.net.parameters())
    resumed.load_state_dict(state)
    resumed.start(fresh)
    assert fresh.opt.param_groups[0]["betas"][1] == 0.95
    carried = CausePolicy(GuardConfig(remedies=list(REMEDIES) + ["beta2"], carry={"beta2": dict(entry.carry)}))
    fresh = FakeIO()
    fresh.opt = torch.optim.Adam(fresh.net.parameters())
    changes = carried.start(fresh)
    assert fresh.opt.param_groups[0]["betas"][1] == 0.95
    assert [x.target for x in changes] == ["optimizer0.group0.betas[1]"]
    assert any("carried from the earlier run" in m for _, m in fresh.logs)


def test_a_remedy_that_is_not_switched_on_is_never_called(registered):
    registered(Beta2)
    io = FakeIO()
    io.opt = torch.optim.Adam(io.net.parameters())
    CausePolicy(GuardConfig()).before_restore(Classification(Cause.DYNAMICS, "x"), io, [], 1)
    assert io.opt.param_groups[0]["betas"][1] == 0.999


def test_register_remedy_names_what_it_refuses(registered):
    with pytest.raises(TypeError, match="takes a Remedy subclass, got <class 'int'>"):
        register_remedy(int)

    class Nameless(Remedy):
        pass

    with pytest.raises(ValueError, match="Nameless.name must be an identifier"):
        register_remedy(Nameless)

    class Taken(Remedy):
        name = "clip"

    with pytest.raises(ValueError, match="a remedy named 'clip' is registered already"):
        register_remedy(Taken)

    class Clash(Remedy):
        name = "clash"
        settings = (Setting("lr_backoff", 0.5, is_number()),)

    with pytest.raises(ValueError, match=r"Clash declares \['lr_backoff'\], taken by another remedy"):
        register_remedy(Clash)
    with pytest.raises(ValueError, match="remedies: unknown entry 'beta2'"):
        GuardConfig(remedies=["beta2"])


def _chain(config):
    """One chain of dynamics incidents (none holds): each incident's rung, as the lr factor and the targets show it."""
    from petr_stability.core.port import Payload

    io, policy = FakeIO(), CausePolicy(config)
    io.opt = torch.optim.Adam(io.net.parameters(), lr=1e-3)
    seen = []
    for n in range(1, 12):
        c, changes = policy.before_restore(Classification(Cause.DYNAMICS, "fine on the healthy weights"), io, [], n)
        if c.cause == Cause.STRUCTURAL:
            seen.append(("structural", c.signals.get("spent")))
            break
        c, later, _ = policy.after_restore(c, io, Payload({}, 0, 0, tags=policy.tags()), n)
        targets = {x.target.split(".")[0] for x in changes + later}
        seen.append((round(policy.remedy("lr").lr_factor, 4), sorted(targets)))
    return seen, io


def test_the_learning_rate_rung_repeats_down_to_lr_min_factor_then_the_next_rung():
    # A rate 5-8x too high needs three halvings (the model zoo): one backoff per incident of a chain, down to
    # lr_min_factor, before the moments reset and, past it, structural with the spent signal (no re-check then).
    seen, io = _chain(GuardConfig(lr_backoff=0.5, lr_min_factor=0.0625))
    assert [s[0] for s in seen] == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.0625, "structural"]
    assert seen[-1] == ("structural", "ladder") and "optimizer0" in seen[4][1] and "optimizer0" not in seen[5][1]
    assert io.opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.0625)
    # lr_min_factor=0.5: one halving, as the ladder did before.
    assert [s[0] for s in _chain(GuardConfig(lr_backoff=0.5, lr_min_factor=0.5))[0]] == [1.0, 0.5, 0.5, "structural"]
    # At the defaults (0.125 down to 1/64): two rungs of the rate.
    assert [s[0] for s in _chain(GuardConfig())[0]] == [1.0, 0.125, 0.0156, 0.0156, "structural"]
    # The rung switched off repeats nothing (never forever).
    off = [s[0] for s in _chain(GuardConfig(remedies=[r for r in REMEDIES if r != "lr"]))[0]]
    assert off == [1.0, 1.0, 1.0, "structural"]
