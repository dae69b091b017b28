"""The remedy registry: each remedy's apply, resume and state round trip against a plain-torch IO, and the lists
(``remedies=``, the ladder, the cause table's remedies, the patched config's fields) read from it."""
import math

import torch
from fake_io import FakeIO

from petr_stability.core.causes import Cause, Classification
from petr_stability.core.config import REMEDIES, GuardConfig
from petr_stability.core.diagnosis.classify import CauseHistory
from petr_stability.core.remedies.adaptive_clip import AdaptiveClip
from petr_stability.core.remedies.base import Context, When
from petr_stability.core.remedies.change import Change
from petr_stability.core.remedies.clip import ClipRemedy
from petr_stability.core.remedies.dropout import DropoutRemedy
from petr_stability.core.remedies.fp32 import Fp32Remedy
from petr_stability.core.remedies.lr import LrBackoff
from petr_stability.core.remedies.moments import MomentsReset
from petr_stability.core.remedies.quarantine import Quarantine
from petr_stability.core.remedies.registry import LADDER, REGISTRY, Remedies, config_fix_fields, serving
from petr_stability.core.remedies.rollback import Rollback
from petr_stability.core.remedies.scale import ScaleDynamic
from petr_stability.core.remedies.temporal import TemporalReset


def _ctx(io, remedies=None, **fields):
    return Context(io, history=CauseHistory(), remedies=remedies, **fields)


def _round_trip(remedy, config):
    again = type(remedy)(config)
    again.load_state_dict(remedy.state_dict())
    assert again.state_dict() == remedy.state_dict()
    return again


def test_the_lists_are_read_from_the_registry():
    assert REMEDIES == ("clip", "dropout", "rollback", "scale", "lr", "moments", "quarantine", "fp32", "temporal")
    assert [r.name for r in LADDER] == ["the known manual fix (transformer dropout 0, max_norm 1)",
                                        "learning rate backoff", "optimizer moments reset"]
    assert [r.remedies for r in LADDER] == [("clip", "dropout"), ("lr",), ("moments",)]
    assert serving(Cause.DATA) == ("quarantine",) and serving(Cause.FORWARD_OVERFLOW) == ("fp32",)
    assert serving(Cause.DYNAMICS) == serving(Cause.UNKNOWN) == ("clip", "dropout", "lr", "moments")
    assert serving(Cause.STRUCTURAL) == ()
    assert len({r.name for r in REGISTRY}) == len(REGISTRY)


def test_the_state_keeps_the_checkpoint_layout_and_fills_the_patched_config():
    remedies = Remedies(GuardConfig())
    state = remedies.state_dict()
    assert set(state) == {"clip", "dropout_zeroed", "scale_made_dynamic", "policy"}
    assert set(state["policy"]) == {"lr_factor", "skip", "sightings", "refused_samples", "fp32"}
    summary = remedies.summary(FakeIO())
    assert config_fix_fields(summary) == {"max_norm": None, "zero_dropout": False, "dynamic_loss_scale": False,
                                          "lr_factor": 1.0, "quarantine": [], "fp32_modules": {}}


def test_clip_remedy_tightens_records_and_resumes():
    config, io = GuardConfig(), FakeIO()
    clip = ClipRemedy(config)
    assert not clip.in_effect(_ctx(io, incident=1))
    assert [c.as_dict() for c in clip.apply(_ctx(io, incident=1))] == [Change("clip.max_norm", 35.0, 1.0).as_dict()]
    assert clip.in_effect(_ctx(io, incident=1)) and clip.summary(io) == {"max_norm": 1.0}
    fresh = FakeIO()
    _round_trip(clip, config).resume(fresh)
    assert fresh.clip["max_norm"] == 1.0


def test_dropout_remedy_zeroes_once_and_again_on_resume():
    config, io = GuardConfig(dropout_scope="all"), FakeIO()
    dropout = DropoutRemedy(config)
    assert dropout.apply(_ctx(io)) and dropout.dropout_zeroed and dropout.in_effect(_ctx(io))
    fresh = FakeIO()
    _round_trip(dropout, config).resume(fresh)
    assert all(m.p == 0 for m in fresh.net.modules() if isinstance(m, torch.nn.Dropout))


def test_lr_backoff_lasts_and_brings_an_older_state_back():
    config, io = GuardConfig(), FakeIO()
    lr = LrBackoff(config)
    lr.apply(_ctx(io))
    assert lr.lr_factor == 0.5 and io.opt.param_groups[0]["lr"] == 0.005 and lr.tags() == {"lr_factor": 0.5}
    assert _round_trip(lr, config).lr_factor == 0.5
    assert LrBackoff.factor_in({"policy": {"lr_factor": 0.25}}) == 0.25 and LrBackoff.factor_in(None) == 1.0
    assert LrBackoff.rung_text(GuardConfig(lr_backoff=0.25)) == "learning rate x 0.25 (schedules too)"


def test_moments_reset_clears_the_optimizer_state():
    io = FakeIO()
    io.opt = torch.optim.Adam(io.net.parameters())
    io.train_step()
    moments = MomentsReset(GuardConfig())
    moments.prepare(_ctx(io))
    assert moments.apply(_ctx(io)) and not any(io.opt.state.values())


def test_scale_dynamic_needs_a_static_scale_and_resumes():
    class StaticIO(FakeIO):
        resumed = False

        def make_scale_dynamic(self):
            return Change("loss_scale", "static 512", "dynamic")

        def restore_scale_mode(self):
            self.resumed = True

    config = GuardConfig()
    scale = ScaleDynamic(config)
    assert scale.apply(_ctx(FakeIO())) == [] and not scale.scale_made_dynamic  # nothing to make dynamic
    assert scale.apply(_ctx(StaticIO())) and scale.when == When.STALLED
    io = StaticIO()
    _round_trip(scale, config).resume(io)
    assert io.resumed
    assert ScaleDynamic(GuardConfig(remedies=["clip"])).apply(_ctx(StaticIO())) == []


def test_quarantine_takes_named_samples_and_recurring_ones():
    config, io = GuardConfig(quarantine_fraction=1.0), FakeIO()
    io.dataset_size = lambda: 10
    quarantine = Quarantine(config)
    quarantine.skip_list(io)
    c = Classification(Cause.DATA, "bad batch", signals={"iteration": 3})
    assert quarantine.apply(_ctx(io, cls=c, ids=[{"index": 4}])) and list(quarantine.skip) == [4]
    assert quarantine.recurring(_ctx(io, iteration=5), [{"index": 7}], epoch=0) is None
    changes, samples, reason = quarantine.recurring(_ctx(io, iteration=9), [{"index": 7}], epoch=1)
    assert changes and samples == [{"index": 7}] and reason == "made steps go wrong in epochs [0, 1]"
    again = _round_trip(quarantine, config)
    assert list(again.skip) == [4, 7]
    assert again.summary(io) == {"quarantined": [4, 7], "refused": [], "bad_samples": [4, 7]}


def test_fp32_remedy_runs_a_module_in_fp32_once_then_structural():
    config, io = GuardConfig(), FakeIO()
    fp32 = Fp32Remedy(config)
    c = Classification(Cause.FORWARD_OVERFLOW, "overflow", modules=["out"])
    assert fp32.apply(_ctx(io, cls=c)) and fp32.summary(io) == {"fp32_modules": {"out": "Linear"}}
    again = Classification(Cause.FORWARD_OVERFLOW, "overflow", modules=["out"])
    assert fp32.apply(_ctx(io, cls=again)) == [] and again.cause == Cause.STRUCTURAL
    assert _round_trip(fp32, config).fp32 == ["out"]


def test_temporal_reset_and_rollback_switch():
    class Memory(torch.nn.Module):
        calls = 0

        def reset_memory(self):
            Memory.calls += 1

    io = FakeIO()
    io.net.memory = Memory()
    assert TemporalReset(GuardConfig()).after_rollback(_ctx(io)) == ["memory"] and Memory.calls == 1
    assert TemporalReset(GuardConfig(remedies=["clip"])).after_rollback(_ctx(io)) == []
    assert Rollback(GuardConfig()).enabled and not Rollback(GuardConfig(remedies=["clip"])).enabled


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
    adaptive.resume(io)
    adaptive.apply(_ctx(io, extra={"spikes": Ready()}))
    assert io.clip["max_norm"] == 2.0
    remedies.get("clip").apply(_ctx(io, incident=1))
    adaptive.after_incident(_ctx(io, remedies=remedies))
    assert adaptive.base == {"clip.max_norm": 1.0} and not math.isnan(io.clip["max_norm"])
