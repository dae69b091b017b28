"""NanGuardHook under MMCV 1.x MMDistributedDataParallel (IterBasedRunner): 2 CPU processes (gloo), torchrun."""
import os

from scenarios import RECURRENCE_BUG, AgreementScenarios


class TestMMCV1DDP(AgreementScenarios):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
    known_bugs = {
        "corrupt_rank1_static": RECURRENCE_BUG,
        # The first ~7 steps are calibration overflows: no snapshot exists, the start state is the only point.
        "corrupt_rank1_dynamic_no_replay": (
            "petr_stability bug (issue 13): the start state is tried once per incident chain; the second divergence "
            "(new corrupt data, 3 iterations after the rollback to it) finds it spent and stops with "
            "NoHealthyStateError although the start state is healthy"),
    }
