"""The wheel carries the native ops' sources where :mod:`impl.ops._build` looks for them (contract D5).

The kernel sources stay in the repository's top-level ``csrc/``; ``pyproject.toml`` maps them into the
data-only package ``impl.ops.csrc``, so a wheel holds them at ``impl/ops/csrc/``, which
:func:`impl.ops._build.source_dir` tries before the checkout's ``csrc/``. Without that mapping a wheel
install has no sources and every use of the native ops fails with ``ExtensionBuildError``.

The wheel is built the way ``pip install`` of the sdist builds it: setuptools' ``build_meta`` makes the
sdist from a clean copy of the checkout (a ``build/`` left there would leak stale files into a wheel) and
the wheel from the unpacked sdist, so a source missing from either shows. About 5-10 s;
``ci/wheel_check.sh`` goes further (pip's isolated build, a fresh venv, the whole ``dstest`` run).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from impl.ops import _build
from impl.ops._build import ExtensionBuildError, source_dir

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
# What the copy leaves out: VCS data, build outputs and caches (as .gitignore), and what the wheel never holds.
_NOT_COPIED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".tox", ".venv*", ".hypothesis", ".pytest_cache",
    ".mypy_cache", ".ruff_cache", "*.so", "dstest-report*", "gpu-out", "bench-out",
)  # fmt: skip


def _csrc_files() -> list[Path]:
    files = sorted(p for p in CSRC.iterdir() if p.is_file())
    assert files, f"{CSRC} holds no sources"
    return files


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args} in {cwd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from the sdist of a clean copy of the checkout."""
    pytest.importorskip("setuptools", minversion="68")  # the build backend pyproject.toml names
    work = tmp_path_factory.mktemp("packaging")
    copy = work / "src"
    shutil.copytree(ROOT, copy, ignore=_NOT_COPIED)
    build = [
        sys.executable,
        "-c",
        "import sys; from setuptools import build_meta as b; getattr(b, sys.argv[1])(sys.argv[2])",
    ]
    _run([*build, "build_sdist", str(work / "sdist")], copy)
    (sdist,) = (work / "sdist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(work / "unpacked", filter="data")
        else:
            tar.extractall(work / "unpacked")  # our own sdist
    (unpacked,) = (work / "unpacked").iterdir()
    _run([*build, "build_wheel", str(work / "wheel")], unpacked)
    (wheel,) = (work / "wheel").glob("*.whl")
    return wheel


def test_wheel_holds_every_source_at_impl_ops_csrc(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        missing = [p.name for p in _csrc_files() if f"impl/ops/csrc/{p.name}" not in names]
        assert not missing, f"csrc/ files missing from {wheel.name} at impl/ops/csrc/: {missing}"
        for path in _csrc_files():
            assert whl.read(f"impl/ops/csrc/{path.name}") == path.read_bytes(), path.name
    stray = sorted(n for n in names if n.split("/")[0] not in ("dstest", "impl") and ".dist-info/" not in n)
    assert not stray, f"files outside dstest/ and impl/ in {wheel.name}: {stray}"


def test_wheel_holds_every_module(wheel: Path) -> None:
    """pyproject.toml lists the packages by hand (a mapped package rules out setuptools' find): a package
    added to dstest/ or impl/ and not listed there would be missing from the wheel."""
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    modules = sorted(
        p.relative_to(ROOT).as_posix()
        for top in ("dstest", "impl")
        for p in (ROOT / top).rglob("*")
        if p.suffix in (".py", ".cpp") or p.name == "py.typed"  # .cpp: dstest.trace.native's C records
    )
    missing = [m for m in modules if m not in names]
    assert not missing, f"missing from {wheel.name} (a package not listed in pyproject.toml?): {missing}"


def test_wheel_holds_the_c_records_source_as_the_checkout_has_it(wheel: Path) -> None:
    """The C records are built from the installed package's own ``records.cpp`` (a wheel without it would fall
    back to the Python records, with a warning, everywhere it is installed)."""
    source = ROOT / "dstest" / "trace" / "native" / "records.cpp"
    with zipfile.ZipFile(wheel) as whl:
        assert whl.read("dstest/trace/native/records.cpp") == source.read_bytes()


def test_installed_wheel_finds_its_sources(wheel: Path, tmp_path: Path) -> None:
    """Unpacked as an install would place it, the wheel's own ``_build`` resolves its own ``impl/ops/csrc/``."""
    site = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
    probe = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from impl.ops import _build; "
        "print(json.dumps({'module': _build.__file__, 'sources': str(_build.source_dir())}))"
    )
    # -I: neither the checkout (cwd, PYTHONPATH) nor user site on sys.path; the unpacked wheel goes first
    found = json.loads(_run([sys.executable, "-I", "-c", probe, str(site)], tmp_path).strip().splitlines()[-1])
    assert Path(found["module"]).resolve() == (site / "impl" / "ops" / "_build.py").resolve(), found
    sources = Path(found["sources"]).resolve()
    assert sources == (site / "impl" / "ops" / "csrc").resolve(), found
    assert sorted(p.name for p in sources.iterdir()) == [p.name for p in _csrc_files()]


def test_source_lookup_resolves_to_the_sources() -> None:
    """In this run (a checkout or an editable install) the lookup falls back to the checkout's csrc/."""
    found = source_dir()
    assert found.is_dir()
    for name in (*_build._CPU_SOURCES, *_build._CUDA_SOURCES):
        assert (found / name).is_file(), name
    if Path(_build.__file__).resolve().is_relative_to(ROOT):
        assert found == CSRC


def test_source_lookup_names_both_places_when_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    places = (tmp_path / "installed", tmp_path / "checkout")
    monkeypatch.setattr(_build, "_SOURCE_DIRS", places)
    with pytest.raises(ExtensionBuildError, match="sources were not found") as caught:
        source_dir()
    assert all(str(p) in str(caught.value) for p in places)
