"""README.md and docs/*.md against the code: the torch floor stated alike everywhere, and every file of the
package they cite exists, cited without a line number (lines move; a cited line once pointed past a file's end).
The commands and flags the docs name are checked against the parser in test_cli.py."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "examples", "README.md")] + sorted(
    glob.glob(os.path.join(ROOT, "docs", "*.md")))
#: A path into the package as the docs write it (``core/...`` in docs/versions.md's "where (petr_stability/)").
_PACKAGE_PATH = re.compile(r"(?<![\w/.-])((?:petr_stability/|core/|adapters/|demo/|configfix/)[\w/.-]*\.py)(:\d+)?")


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_the_torch_floor_is_the_same_in_the_code_setup_and_docs():
    floors = {
        "core/flags.py": re.search(r"supported floor \(torch >= ([\d.]+)\)", _read("petr_stability", "core",
                                                                                  "flags.py")).group(1),
        "setup.py": re.search(r'"torch>=([\d.]+)"', _read("setup.py")).group(1),
        "README.md": re.search(r"torch >= ([\d.]+)", _read("README.md")).group(1),
        "docs/versions.md": re.search(r"^\| torch \| ([\d.]+) ", _read("docs", "versions.md"), re.M).group(1),
    }
    assert len(set(floors.values())) == 1, floors


def _cited():
    for doc in DOCS:
        with open(doc, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                for match in _PACKAGE_PATH.finditer(line):
                    yield os.path.relpath(doc, ROOT), number, match.group(1), match.group(2)


def test_every_package_file_the_docs_cite_exists_without_a_line_number():
    cited = list(_cited())
    assert len(cited) > 30  # the pattern still finds the citations
    missing = [(doc, n, path) for doc, n, path, _ in cited
               if not any(os.path.isfile(os.path.join(ROOT, p)) for p in (path, "petr_stability/" + path))]
    with_line = [(doc, n, path + line) for doc, n, path, line in cited if line]
    assert missing == [] and with_line == []


def render(value):
    """A setting's default as docs/configuration.md writes it: a tuple as a list, the rest as Python writes it."""
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _setting_rows() -> str:
    """The settings tables: the core's in docs/configuration.md, each remedy's with its row in docs/remedies.md."""
    core = _read("docs", "configuration.md").split("| argument | default |", 1)[1].split("\n\n", 1)[0]
    remedies = _read("docs", "remedies.md").split("| setting | default |", 1)[1].split("\n\n", 1)[0]
    return core + "\n" + remedies


def _settings_table():
    rows = {}
    for line in _setting_rows().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.match(r"`([^`]+)`", cells[0]) if cells and cells[0].startswith("`") else None
        if name and "hook only" not in cells[0]:  # a hook's own argument, not a setting of the guard
            rows[name.group(1)] = cells[1].strip("`")
    return rows


def test_the_settings_table_is_every_setting_the_code_declares_with_its_default():
    # Issue 34: a setting documented but refused (max_scale_fall), or one the code has and the docs lack, fails here.
    from petr_stability.core.config import settings

    rows = _settings_table()
    declared = {s.name: s for s in settings()}
    assert sorted(rows) == sorted(declared), (sorted(set(rows) - set(declared)), sorted(set(declared) - set(rows)))
    wrong = {name: (rows[name], render(s.default)) for name, s in declared.items() if rows[name] != render(s.default)}
    assert wrong == {}, wrong


def test_the_settings_table_names_each_remedy_setting_s_remedy():
    # Issue 40: a remedy's setting goes in its remedies= entry; the table says which entry (and which are start
    # states, which stay hook arguments), as the registry declares it.
    from petr_stability.core.config import CORE_SETTINGS
    from petr_stability.core.remedies.registry import REMEDY_TYPES

    core = _read("docs", "configuration.md").split("| argument | default |", 1)[1].split("\n\n", 1)[0]
    marks = dict(re.findall(r"^\| `([^`]+)` ([^|]*)\|", _setting_rows(), re.M))
    # Issue 40: a built-in remedy is its module, its test and its docs row: its settings sit with that row.
    assert [mark for mark in re.findall(r"^\| `[^`]+` \(([^)]*)\)", core, re.M) if "hook only" not in mark] == []
    want = {s.name: (f"(`{r.name}`'s switch)" if s.name == r.switch else
                     f"(remedy `{r.name}`{', a start state' if s.start else ''})")
            for r in REMEDY_TYPES.values() for s in r.settings}
    want.update({s.name: "" for s in CORE_SETTINGS})
    assert {name: marks.get(name, "").strip() for name in want} == want


def test_the_readme_fits_one_screen_and_every_doc_it_moved_out_is_linked():
    # Issue 40: what it is, the two config lines, the two commands, the table and links; the rest is in docs/.
    text = _read("README.md")
    assert len(text.splitlines()) <= 80
    assert text.startswith("# petr_stability\n\n```bash\nmake demo ") and "\nmake test " in text
    assert "custom_hooks = [dict(type='NanGuardHook')]" in text
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", text))
    assert {"overview.md", "how-it-works.md", "configuration.md", "remedies.md", "cli.md"} <= linked
    for name in linked:
        assert os.path.isfile(os.path.join(ROOT, "docs", name)), name


def test_readme_settings_and_defaults_are_the_codes():
    # Every `name=value` the README gives for the hook, and each setting it names in backticks with a number.
    from petr_stability.core.config import settings

    declared = {s.name: s.default for s in settings()}
    text = _read("README.md")
    for name, value in re.findall(r"`(\w+)` \((\d+(?:\.\d+)?)\)", text):
        assert name in declared, name
        assert float(declared[name]) == float(value), (name, value, declared[name])
    for name in re.findall(r"NanGuardHook\(([a-z_]+)=", text):
        assert name in declared, name


def test_the_remedy_docs_class_is_the_example_s_own():
    # Issue 40: a remedy written from docs/remedies.md alone is the one the example runs in both runner families.
    doc = _read("docs", "remedies.md").split("## The class: a relative target", 1)[1]
    block = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert "class DecayBackoff(Remedy):" in block and "def after_restore(self, run: Run, incident: Incident)" in block
    assert block in _read("examples", "user_remedy", "decay_remedy.py")
    # Every event's method the docs' table names is the protocol's, in its order.
    from petr_stability.core.remedies.base import HANDLERS

    table = _read("docs", "remedies.md").split("## The events, in the order of a run", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| [a-z ]+ \| `(\w+)\(", table, re.M) == list(HANDLERS.values())
    assert re.findall(r"^\| ([a-z ]+) \| `", table, re.M) == [e.value for e in HANDLERS]
