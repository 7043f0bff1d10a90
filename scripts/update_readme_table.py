"""Rewrites the configuration table in docs/configuration.md and the rows of README.md's
main-settings table from the code's table (scripts/config_table.py).

    PYTHONPATH=bindings/python .venv/bin/python scripts/update_readme_table.py
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from config_table import markdown, short_row  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rewrite(path, change):
    with open(path) as f:
        text = f.read()
    new = change(text)
    if new != text:
        with open(path, "w") as f:
            f.write(new)


rewrite(os.path.join(ROOT, "docs", "configuration.md"),
        lambda text: re.sub(r"(<!-- config-table:begin[^>]*-->\n)(.*?)(\n<!-- config-table:end -->)",
                            lambda m: m.group(1) + markdown() + m.group(3), text, flags=re.S))
# README.md lists a few variables by hand; each of their rows is the code's wording.
rewrite(os.path.join(ROOT, "README.md"),
        lambda text: re.sub(r"^\| `(TIERFLOW_[A-Z0-9_]+)` \|.*$", lambda m: short_row(m.group(1)), text, flags=re.M))
