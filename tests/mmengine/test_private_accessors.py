"""MMEngine's private attributes behind named accessors: they read and write the real objects, and fail loudly,
naming the attribute, where a runner lacks one."""
import pytest

from petr_stability.adapters.mmengine_runner.private import (
    MissingPrivateAttribute,
    inner_count,
    set_inner_count,
    set_log_scalars,
    set_loop_iter,
    swap_ema_state_dict,
)


def test_the_accessors_reach_mmengine_objects():
    from mmengine.logging import MessageHub

    hub = MessageHub.get_instance("nan_guard_private_accessors")
    set_log_scalars(hub, {"loss": "history"})
    assert hub.log_scalars == {"loss": "history"}


class Bare:
    pass


@pytest.mark.parametrize("call, name", [
    (lambda: set_loop_iter(Bare(), 3), "_iter"),
    (lambda: inner_count(Bare()), "_inner_count"),
    (lambda: set_inner_count(Bare(), 3), "_inner_count"),
    (lambda: set_log_scalars(Bare(), {}), "_log_scalars"),
    (lambda: swap_ema_state_dict(Bare(), {}), "_swap_ema_state_dict"),
])
def test_a_missing_private_attribute_fails_loudly(call, name):
    with pytest.raises(MissingPrivateAttribute, match=f"Bare has no '{name}'"):
        call()


def test_a_present_one_is_used():
    class Wrapper:
        _inner_count = 4

    w = Wrapper()
    set_inner_count(w, 7)
    assert inner_count(w) == 7
