import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(autouse=True)
def _clean_tierflow_env(monkeypatch):
    """Each test starts with no TIERFLOW_* variables (CI may set none; a developer might)."""
    for k in list(os.environ):
        if k.startswith("TIERFLOW_"):
            monkeypatch.delenv(k)
    torch.manual_seed(0)
    yield
