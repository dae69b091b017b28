"""``remedies=`` entries as OpenMMLab components (issue 40 item 3): names or ``dict(type=..., **settings)`` change the
defaults, ``enabled=False`` switches one off, and the old forms (a whole set of names, a remedy's setting on the hook
itself) keep loading with a deprecation notice naming the new form."""
import warnings

import pytest

from petr_stability.core.config import REMEDIES, GuardConfig, read_remedies
from petr_stability.core.remedies import Remedy, When, register_remedy
from petr_stability.core.remedies.lr import LrBackoff
from petr_stability.core.remedies.registry import REMEDY_TYPES
from petr_stability.core.validate import Setting, is_number


@pytest.fixture
def decay():
    """A user's remedy with one setting, registered for one test (the registry is process-wide)."""

    class DecayBackoff(Remedy):
        name = "decay_test"
        events = (When.AFTER_RESTORE,)
        settings = (Setting("decay_test_factor", 0.5, is_number(0.0, 1.0), "weight-decay factor."),)

    register_remedy(DecayBackoff)
    yield DecayBackoff
    REMEDY_TYPES.pop(DecayBackoff.name, None)


def _config(**arguments):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = GuardConfig.from_arguments(arguments)
    notices = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
               and "NanGuardHook" in str(w.message)]
    assert notices == list(config.notices)
    return config


def test_a_dict_entry_adds_to_the_defaults_with_its_settings(decay):
    config = _config(remedies=[dict(type="decay_test", decay_test_factor=0.25)])
    assert config.remedies == REMEDIES + ("decay_test",) and config.decay_test_factor == 0.25
    assert config.notices == ()
    # A name among dict entries adds it too; the type may be the class name or the class.
    assert _config(remedies=["decay_test", dict(type="LrBackoff", lr_backoff=0.25)]).remedies == REMEDIES + (
        "decay_test",)
    assert _config(remedies=[dict(type=LrBackoff, lr_backoff=0.25)]).lr_backoff == 0.25


def test_enabled_false_switches_a_default_off_and_a_bool_switched_remedy_follows_its_setting():
    config = _config(remedies=[dict(type="temporal", enabled=False), dict(type="adaptive_clip")])
    assert "temporal" not in config.remedies and config.adaptive_clip is True
    assert set(config.remedies) == set(REMEDIES) - {"temporal"}
    assert _config(remedies=[dict(type="adaptive_clip", enabled=False)]).adaptive_clip is False
    assert _config(remedies=[dict(type="lr", lr_backoff=0.25)]).remedies == REMEDIES


def test_the_old_forms_keep_loading_with_a_notice_that_names_the_new_form():
    # A list of names only is the whole set, as it was; leaving a default out earns a notice.
    config = _config(remedies=["clip", "rollback"])
    assert config.remedies == ("clip", "rollback")
    (notice,) = config.notices
    assert "dict(type='dropout', enabled=False)" in notice and "['clip', 'rollback']" in notice
    assert _config(remedies=list(REMEDIES)).notices == ()
    # A remedy's tuning on the hook itself: the same value, and the entry it belongs in.
    config = _config(lr_backoff=0.25, max_norm=2.0)
    assert config.lr_backoff == 0.25 and config.max_norm == 2.0 and config.remedies == REMEDIES
    assert sorted(config.notices) == [
        "NanGuardHook(lr_backoff=0.25): a remedy's setting given on the hook is deprecated; give it in the remedy's "
        "entry: remedies=[dict(type='lr', lr_backoff=0.25)]",
        "NanGuardHook(max_norm=2.0): a remedy's setting given on the hook is deprecated; give it in the remedy's "
        "entry: remedies=[dict(type='clip', max_norm=2.0)]"]
    # What a patched config writes on the hook entry (a state the run starts from) and the core's settings: none.
    assert _config(quarantine=[3], fp32_modules=["head"], patience=4, carry={}).notices == ()


@pytest.mark.parametrize("remedies, error, words", [
    ([dict(type="lr", lr_bakoff=0.25)], TypeError, "'lr' has no setting 'lr_bakoff'; did you mean 'lr_backoff'?"),
    ([dict(type="nope")], ValueError, "unknown remedy type 'nope'; choose from ['clip'"),
    ([dict(lr_backoff=0.25)], ValueError, "has no type"),
    (["lr", dict(type="lr")], ValueError, "'lr' is given twice"),
    ([dict(type="lr"), 3], TypeError, "got 3"),
    ([dict(type="lr", enabled="no")], TypeError, "'lr' enabled must be a bool, got 'no'"),
    ([dict(type="lr", lr_backoff=2.0)], ValueError, "lr_backoff must be a number in (0, 1), got 2.0"),
    ([dict(type="adaptive_clip", adaptive_clip=True)], TypeError, "'adaptive_clip' has no setting 'adaptive_clip'"),
])
def test_a_bad_entry_is_refused_naming_it(remedies, error, words):
    with pytest.raises(error) as caught:
        GuardConfig.from_arguments(dict(remedies=remedies))
    assert words in str(caught.value)


def test_a_setting_given_twice_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"'lr' gives lr_backoff=0.25 and NanGuardHook gives lr_backoff=0.5"):
        read_remedies(dict(lr_backoff=0.5, remedies=[dict(type="lr", lr_backoff=0.25)]))
