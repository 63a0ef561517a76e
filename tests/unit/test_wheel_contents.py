"""The wheel carries what an installed ragspec needs at run time: every source of the
compiled CPU kernels (built on first use from the installed package, see
ragspec/backend/cpu/kernels.py).

Regression (issue 40): ``pyproject.toml`` declared ``"ragspec.csrc" = ["*.cpp"]`` after the
sources had moved, so ``pip wheel .`` built a wheel without a single ``.cpp`` or ``.h``, and
a non-editable install crashed on its first generation. The tests run from the checkout, so
nothing noticed; this test builds the wheel from the tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import ragspec

ROOT = Path(ragspec.__file__).resolve().parent.parent
CSRC = Path("ragspec") / "backend" / "cpu" / "csrc"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel . --no-deps --no-build-isolation`` builds from a copy of the
    tree (the copy keeps build/ and *.egg-info out of the checkout): ~10-20 s."""
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("not run from a source tree")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copytree(ROOT / "ragspec", src / "ragspec", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    (built,) = out.glob("ragspec-*.whl")
    return built


def test_wheel_carries_every_kernel_source(wheel):
    # every .cpp and .h of the checkout's csrc/ is in the wheel, at the same package path
    sources = sorted(p.name for p in (ROOT / CSRC).iterdir() if p.suffix in (".cpp", ".h"))
    assert "cpu_kernels.h" in sources and "decoder_step.cpp" in sources
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in sources if f"{CSRC.as_posix()}/{name}" not in names]
    assert missing == []


def test_wheel_carries_the_kernel_loader_and_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "ragspec/backend/cpu/kernels.py",
        "ragspec/backend/cpu/target.py",
        "ragspec/backend/hf.py",
        "ragspec/py.typed",
    ):
        assert path in names
