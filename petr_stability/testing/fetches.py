"""Who is fetching a sample: the training loader, or the guard replaying a batch from dataset indices (the window
trace, the row isolation: :mod:`petr_stability.core.diagnosis.window`). Tests count what each sample was *served* to
training, so the counting datasets keep the guard's replays apart."""
import os
import sys

__all__ = ["guard_replay"]


def guard_replay() -> bool:
    """Whether the caller's fetch comes from the guard's replay of a batch rebuilt from indices (not the loader)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("diagnosis", "window.py")):
            return True
        frame = frame.f_back
    return False
