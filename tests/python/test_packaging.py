"""`pip install .` builds a wheel through scikit-build-core that carries tierflow._C."""

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(os.environ.get("CI_BUILD_WHEEL") != "1",
                    reason="compiles the whole project again (~2 min); .ci/run sets CI_BUILD_WHEEL=1")
def test_wheel_contains_the_extension_and_the_package(tmp_path):
    # --no-build-isolation: build against this environment's torch, as a user with a CUDA torch would.
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(tmp_path), ROOT]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(tmp_path / wheels[0]).namelist()
    assert any(n.startswith("tierflow/_C") and n.endswith(".so") for n in names), names
    for module in ("__init__.py", "optim.py", "_wrap.py", "_report.py", "_config.py", "_meter.py"):
        assert f"tierflow/{module}" in names
