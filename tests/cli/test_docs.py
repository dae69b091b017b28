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
