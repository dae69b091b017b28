"""The work dir, in every family: checked before the first iteration; a write that fails later ends nothing and
loses no record (held in memory, a warning naming the path, written once the work dir takes writes again).

Two ways to make the work dir refuse writes, both honest about what they do:
- ``chmod``: the work dir made read-only (mode 0o555). Root ignores that mode, so where the tests run as root the
  case is skipped (it says so) and the next one stands for it (root without ``CAP_DAC_OVERRIDE`` takes it:
  ``setpriv --inh-caps=-dac_override,-dac_read_search --bounding-set=-dac_override,-dac_read_search python -m
  pytest ...``);
- ``directory``: a directory put where the guard's file goes (``nan_guard_incidents.jsonl``,
  ``nan_guard_patched_config.py``): opening or replacing it fails with an ``OSError`` for root too, as a read-only
  file system's ``EROFS`` or a permission's ``EACCES`` would.
"""
import os
import stat

import pytest
from families import FAMILIES, GUARD

from petr_stability import read_incidents
from petr_stability.adapters.driver import PATCHED_CONFIG_FILE
from petr_stability.core.errors import NanGuardError, UnwritableWorkDirError
from petr_stability.core.records import INCIDENT_FILE

NAMES = [name for name, _ in FAMILIES]
BUILD = dict(FAMILIES)
HOW = ["chmod", "directory"]
MMCV1_CONFIG = ("model = dict(type='PETRLike', pts_bbox_head=dict(transformer=dict(decoder=dict(transformerlayers=dict("
                "attn_cfgs=[dict(dropout=0.1)])))))\n"
                "optimizer_config = dict(grad_clip=dict(max_norm=35, norm_type=2))\n")
MMENGINE_CONFIG = ("model = dict(type='PETRLikeModel')\n"
                   "optim_wrapper = dict(type='AmpOptimWrapper', clip_grad=dict(max_norm=35, norm_type=2))\n"
                   "custom_hooks = [dict(type='NanGuardHook')]\n")


def build(family, work_dir, iters=20, faults=()):
    extra = {}
    if family == "mmcv1":
        extra["meta"] = {"config": MMCV1_CONFIG}
    elif family == "mmengine":
        from mmengine.config import Config

        extra["cfg"] = Config.fromstring(MMENGINE_CONFIG, ".py")
    return BUILD[family](str(work_dir), iters, dict(GUARD), list(faults), "norm", logs=True, **extra)


def chmod_stops_writes(work_dir):
    """Whether mode 0o555 makes ``work_dir`` refuse a new file here (not for root)."""
    os.chmod(work_dir, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        with open(os.path.join(work_dir, ".probe"), "w"):
            pass
    except PermissionError:
        return True
    finally:
        os.chmod(work_dir, 0o755)
    os.remove(os.path.join(work_dir, ".probe"))
    return False


def skip_if_chmod_cannot(how, work_dir):
    if how == "chmod" and not chmod_stops_writes(work_dir):
        pytest.skip("chmod does not stop writes here (root): the 'directory' case stands for it")


def refuse(how, work_dir):
    """Makes the guard's files in ``work_dir`` unwritable; returns the call that makes them writable again."""
    if how == "chmod":
        os.chmod(work_dir, 0o555)
        return lambda: os.chmod(work_dir, 0o755)
    paths = [os.path.join(work_dir, name) for name in (INCIDENT_FILE, PATCHED_CONFIG_FILE)]
    for path in paths:
        os.makedirs(path, exist_ok=True)
    return lambda: [os.rmdir(p) for p in paths if os.path.isdir(p)]


@pytest.mark.parametrize("family", NAMES)
@pytest.mark.parametrize("how", HOW)
def test_an_unwritable_work_dir_fails_before_the_first_iteration_naming_the_path(family, how, tmp_path):
    skip_if_chmod_cannot(how, str(tmp_path))
    run = build(family, tmp_path, iters=4)
    allow = refuse(how, str(tmp_path))
    try:
        with pytest.raises(UnwritableWorkDirError) as caught:
            run.train()
    finally:
        allow()
    message = str(caught.value)
    named = str(tmp_path) if how == "chmod" else os.path.join(str(tmp_path), INCIDENT_FILE)
    assert named in message, message
    assert isinstance(caught.value, PermissionError) and isinstance(caught.value, NanGuardError)
    assert run.completed() == 0  # before the first iteration


@pytest.mark.parametrize("family", NAMES)
@pytest.mark.parametrize("how", HOW)
def test_a_work_dir_refusing_writes_mid_run_ends_nothing_and_loses_no_record(family, how, tmp_path):
    work_dir = str(tmp_path)
    skip_if_chmod_cannot(how, work_dir)
    run = build(family, work_dir, faults=[dict(kind="weights", iters=[12], value="nan")])
    allowed = []
    # Refused from iteration 8 (before the incident at 12); writable again at 16, which only the replay after the
    # rollback to 5 reaches.
    run.at_iteration(8, lambda: allowed.append(refuse(how, work_dir)) if not allowed else None)
    run.at_iteration(16, lambda: [allow() for allow in allowed])
    run.train()
    assert run.completed() == 20 and run.params_finite() and run.guard.recoveries == 1
    (rec,) = read_incidents(work_dir)
    assert rec["event"] == "divergence" and rec["iteration"] == 12 and rec["restored_from"]["iteration"] == 5
    log = os.path.join(work_dir, INCIDENT_FILE)
    assert any(log in line and "could not write" in line for line in run.read_logs().lines), run.read_logs().lines
    assert os.path.isfile(os.path.join(work_dir, PATCHED_CONFIG_FILE))
