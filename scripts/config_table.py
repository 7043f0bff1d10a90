"""Prints the README's configuration table from the code's table (core/src/config.cpp).

    PYTHONPATH=bindings/python .venv/bin/python scripts/config_table.py
tests/python/test_readme.py fails when README.md and this output differ.
"""

import tierflow


def markdown() -> str:
    lines = ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
    for r in tierflow.config_table():
        default = f"`{r['default']}`" if r["default"] else "(empty)"
        lines.append(f"| `{r['name']}` | {default} | {r['accepted']} | {r['doc']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
