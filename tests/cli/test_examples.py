"""examples/mmengine end to end, as a newcomer types it: ``python examples/mmengine/train.py CONFIG --work-dir DIR``.

Each run is a subprocess (the example's own model registers in MMEngine's global registries; this process stays
clean). Asserted: the config carries the README's ``custom_hooks`` line and registers the guard and the model for
any script that reads it; a healthy run finishes with the guard active and no incident; with ``--bad-sample`` (a
corrupt image) the run still finishes, with finite weights and at least one incident record. How the guard recovers
from the bad sample is not asserted here (the hook's own tests do).
"""
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from petr_stability.testing.stacks import require

require("mmengine")

from petr_stability.testing.examples import (  # noqa: E402
    BAD_SAMPLE,
    HANG_S,
    ROOT,
    ExampleRun,
    check_bad_sample,
    check_healthy,
    check_readme_lines,
    example_env,
    load_checkpoint,
    train_example,
)

EXAMPLE = ROOT / "examples" / "mmengine"


def _newest_state_dict(work_dir: Path) -> Dict[str, Any]:
    # MMEngine names its newest checkpoint in `last_checkpoint`.
    return load_checkpoint((work_dir / "last_checkpoint").read_text().strip())["state_dict"]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> ExampleRun:
    return train_example(EXAMPLE, tmp_path_factory.mktemp("healthy") / "work_dir")


@pytest.fixture(scope="module")
def bad_sample(tmp_path_factory) -> ExampleRun:
    return train_example(EXAMPLE, tmp_path_factory.mktemp("bad_sample") / "work_dir", "--bad-sample", str(BAD_SAMPLE))


def test_config_holds_the_readme_lines():
    check_readme_lines(EXAMPLE)


def test_config_loads_outside_its_train_script(tmp_path):
    """Any train script that reads the config with ``Config.fromfile`` gets the guard and the toy model registered."""
    script = tmp_path / "another_train_script.py"
    script.write_text("\n".join([
        "import sys",
        "from mmengine.config import Config",
        "Config.fromfile(sys.argv[1])",
        "from mmengine.registry import HOOKS, MODELS",
        "assert HOOKS.get('NanGuardHook') and MODELS.get('ToyDetector'), 'not registered'",
    ]))
    proc = subprocess.run([sys.executable, str(script), str(EXAMPLE / "config.py")], cwd=str(tmp_path),
                          env=example_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_healthy_run_finishes_guarded_without_incident(healthy):
    check_healthy(healthy, _newest_state_dict(healthy.work_dir))


def test_bad_sample_run_finishes_with_an_incident_record(bad_sample):
    check_bad_sample(bad_sample, _newest_state_dict(bad_sample.work_dir))
