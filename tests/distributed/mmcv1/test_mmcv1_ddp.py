"""NanGuardHook under MMCV 1.x MMDistributedDataParallel (IterBasedRunner): 2 CPU processes (gloo), torchrun."""
import os

from scenarios import AgreementScenarios


class TestMMCV1DDP(AgreementScenarios):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
    known_bugs: dict = {}
