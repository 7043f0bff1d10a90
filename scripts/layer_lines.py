"""Lines of C++/CUDA/Python per layer, bindings/'s share of them, the largest files and any over 700 lines
(issue 40's layout targets). Run from the repository root: python3 scripts/layer_lines.py"""
import json, subprocess, sys
LAYERS = ["core", "allocator", "swap", "tiering", "optimizer", "bindings"]
EXT = (".cpp", ".hpp", ".h", ".cu", ".cuh", ".py")
files = [f for f in subprocess.run(["git", "ls-files", *LAYERS], capture_output=True, text=True, check=True).stdout.split()
         if f.endswith(EXT)]
lines = {f: sum(1 for _ in open(f, encoding="utf-8", errors="replace")) for f in files}
per = {l: sum(n for f, n in lines.items() if f.startswith(l + "/")) for l in LAYERS}
total = sum(per.values())
out = {"lines": per, "total": total, "bindings_share": round(per["bindings"] / total, 4),
       "largest": sorted(((n, f) for f, n in lines.items()), reverse=True)[:8],
       "over_700": [f for f, n in lines.items() if n > 700]}
json.dump(out, sys.stdout, indent=1); print()
