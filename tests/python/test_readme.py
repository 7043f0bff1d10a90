"""The README's configuration table is the code's table, and its commands exist."""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from config_table import markdown  # noqa: E402


def readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_config_table_matches_the_code():
    text = readme()
    m = re.search(r"<!-- config-table:begin[^>]*-->\n(.*?)\n<!-- config-table:end -->", text, re.S)
    assert m, "README.md lost its config-table markers"
    assert m.group(1).strip() == markdown().strip(), (
        "README.md's configuration table is out of date: regenerate it with scripts/update_readme_table.py")


def test_readme_commands_are_what_ci_and_make_run():
    text = readme()
    assert "make demo" in text and "make test" in text and "make cpp-example" in text
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert "make test" in ci and "make cpp-example" in ci
    with open(os.path.join(ROOT, "Makefile")) as f:
        targets = f.read()
    assert re.search(r"^demo:", targets, re.M) and re.search(r"^test:", targets, re.M)
    assert re.search(r"^cpp-example:", targets, re.M)
