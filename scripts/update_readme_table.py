"""Rewrites the configuration table in README.md from the code's table."""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from config_table import markdown  # noqa: E402

path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
text = open(path).read()
new = re.sub(r"(<!-- config-table:begin[^>]*-->\n)(.*?)(\n<!-- config-table:end -->)",
             lambda m: m.group(1) + markdown() + m.group(3), text, flags=re.S)
open(path, "w").write(new)
