"""The petr-stability command itself: --version, python -m petr_stability, help texts, exit status 2, and
docs/cli.md checked against the parser and the demo."""
import argparse
import os
import re
import subprocess
import sys

import pytest

import petr_stability
import petr_stability.cli
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


def test_help_says_what_the_demo_takes_and_names_every_subcommand():
    parser = build_parser()
    text = " ".join(_help_texts().split())
    assert "about 1.5 min on 2 CPU cores" in text and not re.search(r"(?<![\d.])5 min", text)
    description = " ".join(parser.description.split())
    for command in ("demo", "report", "patch-config", "check"):
        assert command in description
    assert "check" in petr_stability.cli.__doc__


def _mmcv1_registered():
    from petr_stability.registry import RUNNER_FAMILIES

    return "mmcv1" in RUNNER_FAMILIES


@pytest.mark.parametrize("argv", [["-m", "petr_stability", "--version"], ["-m", "petr_stability.cli", "--version"]])
def test_version_prints_the_version_only(request, argv):
    # In an MMCV 1.x environment `import petr_stability` registers the hooks with MMCV 1.x, whose import announces
    # mmcv 2.0 and makes torch log its CUDA_HOME: the registry keeps both quiet (petr_stability/registry.py).
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 0
    assert res.stdout == f"petr-stability {petr_stability.__version__}\n"
    assert res.stderr == ""


# ------------------------------------------------------------------ docs/cli.md against the code
DOC = os.path.join(ROOT, "docs", "cli.md")


def _doc_text():
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def _options(parser):
    return {s for a in parser._actions for s in a.option_strings}


def _subparsers():
    parser = build_parser()
    return parser, next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_and_flag_in_the_doc_exists_and_every_one_is_documented():
    parser, subs = _subparsers()
    usage = [line.strip() for line in re.findall(r"^petr-stability [^\n]*", _doc_text(), re.M)]
    named = {}
    for line in usage:
        words = line.split()[1:]
        command = words[0] if not words[0].startswith("-") else None
        named.setdefault(command, set()).update(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", " ".join(words)))
    assert set(named) - {None} == set(subs), usage
    assert named[None] <= _options(parser)
    for command, flags in named.items():
        if command is not None:
            assert flags <= _options(subs[command]), (command, flags - _options(subs[command]))
            undocumented = [a.option_strings for a in subs[command]._actions
                            if a.option_strings and not set(a.option_strings) & (flags | {"-h"})]
            assert not undocumented, (command, undocumented)


def test_the_doc_names_the_demo_dirs_the_demo_writes():
    from petr_stability.demo import run as demo

    text = " ".join(_doc_text().split("## `demo`")[1].split("## ")[0].split())
    assert "WORK_DIR/<scenario>/<run>/" in text
    assert "a_default" not in text and "c_guarded" not in text
    for name in list(demo.SCENARIOS) + list(demo.RUNS) + ["demo.png", "summary.json", "details.json"]:
        assert f"`{name}`" in text or f"WORK_DIR/{name}" in text, name


def test_the_docs_check_example_is_what_check_prints(capsys):
    block = _doc_text().split("$ petr-stability check ")[1].split("```")[0]
    argv = block.splitlines()[0].split()
    assert main(["check", *argv]) == 0
    out = capsys.readouterr().out
    for line in block.splitlines()[1:]:
        line = line.split("; ...")[0].strip()
        if line and line != "...":
            assert line in out, line


def test_the_docs_in_place_statement_matches_the_code():
    text = " ".join(_doc_text().split())
    assert "never overwritten" in text and "`CONFIG.bak.1`" in text
    assert "CONFIG.bak" in " ".join(_help_texts().split())


def test_no_subcommand_is_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
