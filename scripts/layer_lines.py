"""Lines of C++/CUDA/Python per layer, bindings/'s share of them, the largest files, any over 700 lines and the
functions over 100 lines (issue 40's layout targets). Run from the repository root: python3 scripts/layer_lines.py

A function's lines run from its signature's first line (its decorators left out, a template<...> line counted) to
its closing brace or last statement. Python is read with ast; C++ with a brace scan over the text without its
comments, literals and preprocessor lines: a block opened after a ')' (and its qualifiers) outside any function
is a function, a class or namespace body is looked into, a lambda counts in the function that holds it."""
import ast, json, re, subprocess, sys

LAYERS = ["core", "allocator", "swap", "tiering", "optimizer", "bindings"]
EXT = (".cpp", ".hpp", ".h", ".cu", ".cuh", ".py")
LONGEST = 100  # lines a function may have


def strip_cpp(text: str) -> str:
    """`text` with comments, string and character literals and preprocessor lines blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#":  # a directive, with its continuation lines
            j = i
            while j < n and (text[j] != "\n" or text[j - 1] == "\\"):
                j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
            continue
        if c == "/" and text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        raw = re.match(r'R"([^(\s]*)\(', text[i:i + 20]) if c == "R" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")) else None
        if raw:
            end = text.find(")" + raw.group(1) + '"', i)
            j = n if end < 0 else end + len(raw.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c in "\"'" and not (c == "'" and i > 0 and text[i - 1].isalnum()):  # not a digit separator (1'000)
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
            i = j + 1
            continue
        out.append(c)
        line_start = c == "\n" or (line_start and c in " \t")
        i += 1
    return "".join(out)


SCOPE = re.compile(r"\b(namespace|class|struct|union|enum|extern)\b")
FUNCTION_END = re.compile(r"\)\s*(const|noexcept|override|final|mutable|volatile|&|&&|->[^{;]*|\s|noexcept\s*\([^)]*\))*$")


def function_name(header: str) -> str:
    """The name a function's header gives it: "Foo::bar", "operator==", or a lambda's variable."""
    m = re.search(r"(\w+)\s*=\s*\[[^\]]*\]\s*\(", header)  # a lambda at namespace scope
    if m:
        return m.group(1)
    m = re.search(r"((?:[~\w]+::)*(?:operator\s*[^\s(]+|~?\w+))\s*(?:<[^()]*>)?\s*\(", header)
    return m.group(1) if m else "?"


def cpp_functions(text: str):
    """(name, first line, last line) of each function defined in C++ `text`."""
    s = strip_cpp(text)
    stack = []  # per open brace: "scope" (namespace, class), "function", "block" (inside a function), "init"
    start = 0  # where the text before the next brace starts at the current level
    found = []
    opened = []  # (name, first line) of the functions open
    for i, ch in enumerate(s):
        if ch == ";" and (not stack or stack[-1] == "scope"):
            start = i + 1
        elif ch == "{":
            inside = any(k == "function" for k in stack)
            header = s[start:i]
            flat = " ".join(header.split())
            if inside:
                stack.append("block")
            elif SCOPE.search(flat) and "(" not in flat.split("{")[0]:
                stack.append("scope")
                start = i + 1
            elif "(" in flat and (FUNCTION_END.search(flat) or (re.search(r"\)\s*:", flat) and flat.endswith("}"))):
                stack.append("function")  # after its parameters, or after a constructor's initializer list
                first = start + len(header) - len(header.lstrip())
                opened.append((function_name(flat), s.count("\n", 0, first) + 1))
            else:
                stack.append("init")  # a brace initializer (a member's in an initializer list, a variable's)
        elif ch == "}" and stack:
            kind = stack.pop()
            if kind == "function":
                name, first = opened.pop()
                found.append((name, first, s.count("\n", 0, i) + 1))
            if kind in ("scope", "function"):
                start = i + 1
    return found


def py_functions(text: str):
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.name, node.lineno, node.end_lineno))
    return out


def long_functions(files):
    out = []
    for f in files:
        text = open(f, encoding="utf-8", errors="replace").read()
        for name, first, last in (py_functions(text) if f.endswith(".py") else cpp_functions(text)):
            if last - first + 1 > LONGEST:
                out.append((last - first + 1, f"{f}:{name}:{first}"))
    return [f"{where} ({n} lines)" for n, where in sorted(out, reverse=True)]


if __name__ == "__main__":
    files = [f for f in subprocess.run(["git", "ls-files", *LAYERS], capture_output=True, text=True,
                                       check=True).stdout.split() if f.endswith(EXT)]
    lines = {f: sum(1 for _ in open(f, encoding="utf-8", errors="replace")) for f in files}
    per = {l: sum(n for f, n in lines.items() if f.startswith(l + "/")) for l in LAYERS}
    total = sum(per.values())
    out = {"lines": per, "total": total, "bindings_share": round(per["bindings"] / total, 4),
           "largest": sorted(((n, f) for f, n in lines.items()), reverse=True)[:8],
           "over_700": [f for f, n in lines.items() if n > 700],
           f"functions_over_{LONGEST}": long_functions(files)}
    json.dump(out, sys.stdout, indent=1); print()
