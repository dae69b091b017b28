"""A remedy of the user's own (examples/user_remedy, registered through custom_imports) on a real MMCV 1.x run:
it acts on its cause, its state survives a checkpoint and a resume, and the patched config carries it into the
next run (issue 32)."""
from pathlib import Path

from petr_stability.testing.examples import ROOT, check_user_remedy


def test_a_user_remedy_acts_rides_in_checkpoints_and_is_carried_to_the_next_run(tmp_path: Path):
    check_user_remedy(ROOT / "examples" / "mmcv1", tmp_path, "resume_from={ckpt}")
