"""The layering check (``ci/layers.py``, docs/architecture.md): imports go down the layers only.

It passes on the repository as it is, and fails, naming the importer, the line, both modules and both layers,
when a world imports the spec layer or ``impl`` imports dstest (a copy of the packages with one planted
import each).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parent.parent


def _layers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dstest_ci_layers", ROOT / "ci" / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy(tmp_path: Path) -> Path:
    for package in ("dstest", "impl"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tmp_path


def test_the_repository_keeps_its_layers() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "ci" / "layers.py")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "layers hold"


def test_a_world_importing_the_spec_layer_fails_the_check(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    world = root / "dstest" / "worlds" / "fake.py"
    lines = world.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("from dstest"))
    lines.insert(at, "from dstest.specification import spec_info")
    world.write_text("\n".join(lines) + "\n")
    found = _layers().violations(root)
    assert found == [
        f"dstest/worlds/fake.py:{at + 1}: dstest.worlds.fake (layer 'worlds') imports dstest.specification "
        "(layer 'spec'): a module imports only its own layer and those below it (ci/layers.py, docs/architecture.md)"
    ]
    done = subprocess.run(
        [sys.executable, str(ROOT / "ci" / "layers.py"), str(root)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert "1 imports go up a layer" in done.stdout


def test_impl_importing_dstest_fails_the_check(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "impl" / "planted.py").write_text("def f():\n    import dstest.errors\n")
    found = _layers().violations(root)
    assert found == ["impl/planted.py:2: impl.planted imports dstest.errors: impl (the runtime under test) never imports dstest"]


def test_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    """Annotations may name any layer: ``if TYPE_CHECKING:`` imports run nowhere."""
    root = _copy(tmp_path)
    planted = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dstest.specification import SpecInfo\n"
    (root / "dstest" / "worlds" / "planted.py").write_text(planted)
    assert _layers().violations(root) == []
    (root / "dstest" / "worlds" / "planted.py").write_text(planted.replace("if TYPE_CHECKING:", "if True:"))
    assert len(_layers().violations(root)) == 1


def test_architecture_page_shows_the_layers_of_the_check() -> None:
    """docs/architecture.md's table is the one ``ci/layers.py --table`` prints: the drawing and the check agree."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert _layers().table() in page
