"""Prints the configuration table of docs/configuration.md from the code's table (core/src/config.cpp).

    PYTHONPATH=bindings/python .venv/bin/python scripts/config_table.py
tests/python/test_readme.py fails when docs/configuration.md and this output differ, or when a row
of README.md's main-settings table differs from short_row() of its variable;
scripts/update_readme_table.py rewrites both.
"""

import tierflow


def markdown() -> str:
    lines = ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
    for r in tierflow.config_table():
        default = f"`{r['default']}`" if r["default"] else "(empty)"
        lines.append(f"| `{r['name']}` | {default} | {r['accepted']} | {r['doc']} |")
    return "\n".join(lines)


def short_row(name: str) -> str:
    """The row of README.md's main-settings table for the variable `name`: variable, default, meaning."""
    for r in tierflow.config_table():
        if r["name"] == name:
            default = f"`{r['default']}`" if r["default"] else "(empty)"
            return f"| `{r['name']}` | {default} | {r['doc']} |"
    raise KeyError(f"{name} is not in the configuration table")


if __name__ == "__main__":
    print(markdown())
