"""The documentation agrees with the code and with itself: docs/configuration.md's table is the code's
table, README.md's main settings are rows of it, README.md's commands exist, README.md stays short,
every relative link (and its #anchor) resolves, and every page under docs/ is linked from README.md."""

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from config_table import markdown, short_row  # noqa: E402

README_MAX_LINES = 250


def read(relpath: str) -> str:
    with open(os.path.join(ROOT, relpath)) as f:
        return f.read()


def readme() -> str:
    return read("README.md")


def docs_pages() -> list:
    """docs/*.md, as paths relative to the repository root."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def without_code(text: str) -> str:
    """The text with fenced code blocks and inline code removed: a `#include` or `[i](x)` there is code."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, spaces to '-', characters other than letters, digits,
    '-' and '_' dropped (markdown emphasis and code marks go with them)."""
    return "".join(c for c in heading.strip().lower().replace(" ", "-") if c.isalnum() or c in "-_")


def anchors(text: str) -> set:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S),
                         re.M):
        a = anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def links(text: str) -> list:
    """The targets of inline markdown links [text](target) outside code."""
    return [m.group(1) for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", without_code(text))]


def test_config_table_matches_the_code():
    text = read(os.path.join("docs", "configuration.md"))
    m = re.search(r"<!-- config-table:begin[^>]*-->\n(.*?)\n<!-- config-table:end -->", text, re.S)
    assert m, "docs/configuration.md lost its config-table markers"
    assert m.group(1).strip() == markdown().strip(), (
        "docs/configuration.md's configuration table is out of date: regenerate it with "
        "scripts/update_readme_table.py")


def test_readme_main_settings_are_the_codes_rows():
    rows = re.findall(r"^\| `(TIERFLOW_[A-Z0-9_]+)` \|.*$", readme(), re.M)
    assert len(rows) >= 5, "README.md lost its main-settings table"
    for line in re.finditer(r"^\| `(TIERFLOW_[A-Z0-9_]+)` \|.*$", readme(), re.M):
        assert line.group(0) == short_row(line.group(1)), (
            f"README.md's row of {line.group(1)} is out of date: regenerate it with scripts/update_readme_table.py")


def test_readme_commands_are_what_ci_and_make_run():
    text = readme()
    assert "make demo" in text and "make test" in text and "make cpp-example" in text
    ci = read(os.path.join(".ci", "run"))
    assert "make test" in ci and "make cpp-example" in ci
    targets = read("Makefile")
    assert re.search(r"^demo:", targets, re.M) and re.search(r"^test:", targets, re.M)
    assert re.search(r"^cpp-example:", targets, re.M)


def test_readme_is_short():
    n = len(readme().splitlines())
    assert n < README_MAX_LINES, (
        f"README.md has {n} lines, at most {README_MAX_LINES - 1} allowed: move reference material to docs/")


def test_relative_links_resolve():
    pages = ["README.md"] + docs_pages()
    assert len(pages) > 1, "docs/ has no pages"
    broken = []
    for page in pages:
        text = read(page)
        for target in links(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                continue
            path, _, frag = target.partition("#")
            if path:
                dest = os.path.normpath(os.path.join(os.path.dirname(page), path))
                if dest.startswith(".."):
                    broken.append(f"{page}: {target} (outside the repository)")
                    continue
                if not os.path.exists(os.path.join(ROOT, dest)):
                    broken.append(f"{page}: {target} (no such file)")
                    continue
            else:
                dest = page
            if frag and dest.endswith(".md") and frag not in anchors(read(dest)):
                broken.append(f"{page}: {target} (no heading with that anchor in {dest})")
            elif frag and not dest.endswith(".md"):
                broken.append(f"{page}: {target} (anchor into a file that is not markdown)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(t.partition("#")[0]) for t in links(readme()) if t.partition("#")[0]}
    missing = [p for p in docs_pages() if os.path.normpath(p) not in linked]
    assert not missing, f"README.md links to none of: {', '.join(missing)}"


def test_anchor_rule():
    assert anchor("Reliability: faults, fuzz, sanitizers") == "reliability-faults-fuzz-sanitizers"
    assert anchor("Budgets at `wrap`") == "budgets-at-wrap"
    assert anchor("From C++ (LibTorch)") == "from-c-libtorch"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_files_the_readme_names_exist():
    """The Layout table and "Where each decision lives" name files in backticks: each must be there."""
    named = re.findall(r"`((?:core|allocator|swap|tiering|optimizer|bindings|tests|benchmarks|examples|docs)/"
                       r"[\w./-]+\.(?:hpp|cpp|py|md))`", readme())
    assert len(named) >= 5, named
    missing = [p for p in named if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"README.md names files that do not exist: {missing}"


def test_the_demo_sample_is_a_recorded_run_that_the_demo_still_prints():
    """README.md's sample of make demo's output is docs/demo-output.txt's lines (a real run, recorded by
    scripts/readme_sample.py --run), and the demo's code still prints every line the sample shows."""
    import readme_sample
    assert readme_sample.readme_sample(readme()) == readme_sample.recorded_sample(), (
        "README.md's demo sample is not docs/demo-output.txt's: run scripts/readme_sample.py (--run for a new run)")
    printed = read(os.path.join("examples", "train_gpt.py")) + read(os.path.join("bindings", "python", "tierflow",
                                                                                 "_report.py"))
    printed += read(os.path.join("tiering", "src", "report_text.cpp"))  # the report's table (tiering::report_text)
    for prefix in readme_sample.SAMPLE:
        assert prefix in printed, f"the demo no longer prints {prefix!r}: record a new run"
