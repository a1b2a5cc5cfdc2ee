"""The built wheel contains every subpackage of the three mapped folders (style.md §3.1).

Built from a clean copy of the tree: a stale build/ directory could carry a package into the
wheel that the package list no longer names. Oracle: the `__init__.py` files on disk.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"src/freetoken": "freetoken", "cli": "freetoken/cli", "converters": "freetoken/converters"}


def test_wheel_contains_every_subpackage(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", ".*", "__pycache__", "tests"))
    cmd = [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    checked = 0
    for folder, pkg in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            assert f"{pkg}/{init.relative_to(ROOT / folder).as_posix()}" in names, init
            checked += 1
    assert checked >= 10
    assert "freetoken/cli/generate.py" in names and "freetoken/converters/gguf.py" in names
