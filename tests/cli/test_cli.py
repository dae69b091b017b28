"""The petr-stability command itself: --version and --help without torch, python -m petr_stability, help texts,
exit statuses (usage 2, failure 1, a reader that went away 141, quietly), a missing dependency named with what to
install, and every command and flag that README.md and docs/*.md name checked against the parser."""
import argparse
import glob
import json
import os
import re
import subprocess
import sys

import pytest

import petr_stability
import petr_stability.cli
import petr_stability_cli
from petr_stability.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "streampetr_vov_flash_800_bs2_seq_24e_nanguard.py")
#: Subprocesses here take seconds; this only ends a hung one. Never a speed limit: a loaded machine passes too.
HANG_S = 1800


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _python(*argv, **kwargs):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=HANG_S, **kwargs)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"petr-stability {petr_stability.__version__}"
    assert petr_stability_cli.__version__ == petr_stability.__version__
    assert petr_stability.cli.main is petr_stability_cli.main  # one command under both names


def test_help_and_version_import_neither_torch_nor_a_framework():
    # The console script's module (setup.py's entry point; the wheel test reads it back) parses every --help, the
    # version and a usage error with argparse alone: nothing of torch, mmcv, mmengine or the package is imported.
    code = "\n".join([
        "import json, sys",
        "import petr_stability_cli as cli",
        "for argv in (['--help'], ['--version'], ['demo', '--help'], ['report', '--help'], ['check', '--help'],",
        "             ['patch-config', '--help'], ['check', 'c.py', '--gpus', '-1'], []):",
        "    try:",
        "        cli.main(argv)",
        "    except SystemExit:",
        "        pass",
        "heavy = ('torch', 'mmcv', 'mmengine', 'numpy', 'petr_stability')",
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))",
    ])
    res = _python("-c", code)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
    assert "argument --gpus: must be an integer >= 1, got -1" in res.stderr


@pytest.mark.parametrize("module", ["petr_stability", "petr_stability.cli"])
def test_python_dash_m_prints_the_version_only(module):
    # `python -m` imports the package (torch, and the hooks' registration). In an MMCV 1.x environment that
    # registration imports MMCV 1.x, whose import announces mmcv 2.0 and makes torch log its CUDA_HOME: the registry
    # keeps both quiet (petr_stability/registry.py).
    res = _python("-m", module, "--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"petr-stability {petr_stability.__version__}\n"
    assert res.stderr == ""


def test_python_dash_m_runs_a_subcommand():
    res = _python("-m", "petr_stability", "patch-config", "c.json", "-o", "x.py")
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
    assert "check" in petr_stability.cli.__doc__ and "check" in petr_stability_cli.__doc__
    assert "exit status: 0 success, 1 the command failed" in text


def test_the_parser_knows_the_demo_it_runs():
    # The parser names the scenarios and the smallest --iters without importing the demo (torch, mmengine).
    from petr_stability.demo.run import MIN_ITERS, SCENARIOS

    assert petr_stability_cli.DEMO_SCENARIOS == tuple(SCENARIOS)
    assert petr_stability_cli.DEMO_MIN_ITERS == MIN_ITERS


# ------------------------------------------------------------------ exit statuses
def test_no_subcommand_is_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_demo_usage_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--iters", "12"])
    assert exc.value.code == 2
    assert "argument --iters: must be an integer >= 24, got 12" in capsys.readouterr().err


def _closed_pipe():
    """A pipe whose reader is gone (a `| head` that has read what it wanted): every write breaks."""
    read, write = os.pipe()
    os.close(read)
    return write


def test_a_reader_that_went_away_ends_the_command_quietly_with_141(monkeypatch, capsys):
    stdout = os.fdopen(_closed_pipe(), "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        assert main(["check", CONFIG, "--gpus", "2"]) == 141
    finally:
        monkeypatch.undo()
        stdout.close()  # flushes into /dev/null: the command pointed the broken fd there
    assert capsys.readouterr().err == ""


def test_a_broken_pipe_that_is_not_stdout_is_no_quiet_exit(monkeypatch):
    import petr_stability.tools.preflight as tool

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a worker's pipe: stdout itself is fine

    monkeypatch.setattr(tool, "main", broken)
    with pytest.raises(BrokenPipeError):
        main(["check", CONFIG])


def test_head_closing_the_pipe_in_a_real_process():
    # `petr-stability check CONFIG | head -0`, as the shell runs it: before, 'error: [Errno 32] Broken pipe', exit 2
    write = _closed_pipe()
    try:
        res = subprocess.run([sys.executable, "-m", "petr_stability", "check", CONFIG, "--gpus", "2"], stdout=write,
                             stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, timeout=HANG_S)
    finally:
        os.close(write)
    assert (res.returncode, res.stderr) == (141, "")


def test_interrupt_is_130_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    import petr_stability.tools.preflight as tool

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tool, "main", interrupted)
    assert main(["check", CONFIG]) == 130
    assert "interrupted" in capsys.readouterr().err

    def bug(args):
        raise RuntimeError("a bug, not a bad input")

    monkeypatch.setattr(tool, "main", bug)
    with pytest.raises(RuntimeError, match="a bug"):  # not hidden behind a one-line message
        main(["check", CONFIG])


def test_demo_without_mmcv_names_what_to_install(tmp_path, monkeypatch, capsys):
    # Checked before the first run: the demo's plot would have needed matplotlib only after 1.5 min of training.
    monkeypatch.setitem(sys.modules, "mmcv", None)  # find_spec and import see no mmcv
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    work = tmp_path / "demo"
    assert main(["demo", "--quick", "--work-dir", str(work)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("petr-stability demo: error: demo needs mmcv and matplotlib, not installed here")
    assert "pip install mmcv-lite" in err and "petr_stability[plot]" in err and "Traceback" not in err
    assert not work.exists()


def test_without_torch_every_subcommand_says_to_install_torch():
    code = ("import sys; sys.modules['torch'] = None; import petr_stability_cli as cli; "
            "sys.exit(cli.main(['report', '.']))")
    res = _python("-c", code)
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("petr-stability report: error: torch is not installed")
    assert "pip install torch" in res.stderr and "Traceback" not in res.stderr


# ------------------------------------------------------------------ README.md and docs/*.md against the parser
DOC = os.path.join(ROOT, "docs", "cli.md")
_COMMAND = re.compile(r"(?:^|\s|`|\$ )(?:petr-stability|python -m petr_stability(?:\.cli)?)(?=[\s`]|$)([^`\n]*)")
_FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def _doc_text(path=DOC):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _options(parser):
    return {s for a in parser._actions for s in a.option_strings}


def _subparsers():
    parser = build_parser()
    return parser, next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _named_in(text):
    """(command or None, flags) for each `petr-stability ...` / `python -m petr_stability ...` in code spans and
    code blocks; the words stop at a comment (`#`) or a shell pipe."""
    code = re.findall(r"```.*?```", text, re.S) + re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)
    found = []
    for chunk in code:
        for match in _COMMAND.finditer(chunk):
            words = []
            rest = match.group(1).split()
            for i, word in enumerate(rest):
                if word.startswith("#") or word in ("|", "\\|") and re.match(r"[a-z]", (rest[i + 1:] or ["x"])[0]):
                    break  # a comment, or a shell pipe (`| head`; `(-o OUT | --in-place)` is usage notation)
                if word != "...":  # `python -m petr_stability ...`: any subcommand
                    words.append(word)
            if words and words[0].startswith("<"):
                continue  # `petr-stability <command>: error: ...`: any subcommand, a placeholder
            command = words[0] if words and not words[0].startswith("-") else None
            found.append((command, set(_FLAG.findall(" ".join(words)))))
    return found


def test_every_command_and_flag_named_in_the_docs_exists():
    parser, subs = _subparsers()
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "examples", "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "*.md")))
    seen = 0
    for path in paths:
        for command, flags in _named_in(_doc_text(path)):
            seen += 1
            where = (os.path.relpath(path, ROOT), command, sorted(flags))
            if command is None:
                assert flags <= _options(parser), where
            else:
                assert command in subs, where
                assert flags <= _options(subs[command]), where
    assert seen > 20  # the docs name the command often: a parser that finds nothing is broken


def test_the_docs_checker_catches_what_the_parser_lacks():
    _, subs = _subparsers()
    named = _named_in("Run `petr-stability check CONFIG --gpu 2`:\n```\npetr-stability repor WORK_DIR  # -x\n```\n")
    assert ("repor", set()) in named and ("check", {"--gpu"}) in named
    assert "--gpu" not in _options(subs["check"]) and "repor" not in subs


def test_every_flag_of_the_parser_is_in_the_docs_usage_block():
    parser, subs = _subparsers()
    usage = [line.strip() for line in re.findall(r"^petr-stability [^\n]*", _doc_text(), re.M)]
    named = {}
    for line in usage:
        for command, flags in _named_in(f"`{line}`"):
            named.setdefault(command, set()).update(flags)
    assert set(named) - {None} == set(subs), usage
    assert _options(parser) - {"-h", "--help"} <= named[None]
    for command, sub in subs.items():
        undocumented = [a.option_strings for a in sub._actions
                        if a.option_strings and not set(a.option_strings) & (named[command] | {"-h"})]
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


def test_the_docs_exit_statuses_are_the_commands():
    text = " ".join(_doc_text().split())
    for status in (petr_stability_cli.EXIT_USAGE, petr_stability_cli.EXIT_FAILURE, petr_stability_cli.EXIT_SIGPIPE,
                   petr_stability_cli.EXIT_INTERRUPTED):
        assert f"| {status} |" in text, status
