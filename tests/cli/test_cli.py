"""The petr-stability command itself: --version, python -m petr_stability, help texts, exit status 2."""
import os
import subprocess
import sys

import pytest

import petr_stability
from petr_stability.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"petr-stability {petr_stability.__version__}"


def test_python_dash_m():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "petr_stability", "--version"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"petr-stability {petr_stability.__version__}"
    res = subprocess.run([sys.executable, "-m", "petr_stability", "patch-config", "c.json", "-o", "x.py"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "c.json" in res.stderr


def _help_texts():
    parser = build_parser()
    texts = [parser.format_help()]
    for action in parser._subparsers._group_actions:  # every subcommand's own help
        texts += [p.format_help() for p in action.choices.values()]
    return "\n".join(texts)


def test_help_names_the_fix_not_the_seed():
    text = " ".join(_help_texts().split())
    assert "seed" not in text
    assert "the known manual fix (transformer dropout 0, max_norm 1)" in text


def test_no_subcommand_is_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
