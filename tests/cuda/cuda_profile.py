"""How the cuda group runs here: on a GPU, or as a CPU rehearsal of the same test code.

On a GPU (the real run) the runners' own fp16 classes are used: MMEngine's ``AmpOptimWrapper``, MMCV's
``Fp16OptimizerHook`` with ``@auto_fp16``, NCCL, and CUDA's own report of host-device synchronizations.

``PETR_STABILITY_CUDA_REHEARSAL=1`` without a GPU runs the same tests with the CPU stand-ins (CPU GradScaler and
autocast, gloo, and tensor-value reads counted in place of CUDA synchronizations). It checks the test code and the
scenarios, not CUDA: `make test` runs it so that the GPU's few minutes are not spent on a broken test.
"""
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, List

import pytest
import torch

from petr_stability.testing.reads import count_host_reads, cuda_syncs

REHEARSAL_VAR = "PETR_STABILITY_CUDA_REHEARSAL"


@dataclass(frozen=True)
class Profile:
    on_gpu: bool
    device: str
    mmengine_amp: str
    mmcv1_fp16: str
    #: a context manager yielding the list of host-device synchronizations (GPU) or tensor reads (rehearsal)
    recorder: Callable[[], ContextManager[List[str]]]
    backend: str
    worker_args: List[str] = field(default_factory=list)

    def nproc(self) -> int:
        return min(2, torch.cuda.device_count()) if self.on_gpu else 1


def _profile() -> Any:
    if torch.cuda.is_available():
        return Profile(True, "cuda", "AmpOptimWrapper", "Fp16OptimizerHook", cuda_syncs, "nccl", ["--cuda"])
    if os.environ.get(REHEARSAL_VAR) == "1":
        return Profile(False, "cpu", "CPUAmpOptimWrapper", "CPUFp16OptimizerHook", count_host_reads,
                       "gloo")
    return None


PROFILE = _profile()
#: Every test of the group: marked `cuda`, skipped where neither a GPU nor the rehearsal is there.
MARKS = [pytest.mark.cuda,
         pytest.mark.skipif(PROFILE is None, reason=f"needs a CUDA GPU ({REHEARSAL_VAR}=1: a CPU rehearsal)")]
