#!/usr/bin/env bash
# The wheel, as a user installs it: nothing of the checkout on sys.path, the native ops built from the
# sources the wheel carries (impl/ops/csrc/, mapped from the top-level csrc/ in pyproject.toml).
#
# 1. a clean copy of the working tree (git's tracked and untracked-but-not-ignored files: a build/ left in
#    the checkout, whose stale files setuptools would put in the wheel, stays out);
# 2. from it: the wheel (pip wheel, isolated build like `pip wheel .`) and the sdist (setuptools'
#    build_meta in a small build venv), then a wheel from the sdist; the two wheels must hold the same
#    files with the same contents, and every file of csrc/ must be at impl/ops/csrc/;
# 3. a fresh venv with torch==2.13.0 and the wheel; from a directory outside the checkout, dstest, impl and
#    the kernel sources must come from the venv's site-packages;
# 4. the main job, `dstest`, with a fresh extension cache (DSTEST_EXT_DIR), so the ops are compiled from
#    the wheel's sources (about 30 s on two cores) and nothing is shared with other runs' caches;
# 5. the same copy installed editable (pip install -e): the sources are found in the copy's csrc/.
#
# Exits non-zero when any step fails. About 3-5 minutes on two cores, most of it the dstest run.
#
# Usage: ci/wheel_check.sh            (PYTHON=python3.11 to choose the interpreter; KEEP=1 keeps the work dir)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
torch_req="torch==2.13.0"

out="$(mktemp -d "${TMPDIR:-/tmp}/wheel_check.XXXXXX")"
if [[ "${KEEP:-0}" == 1 ]]; then
  echo "wheel_check: work dir $out (kept)"
else
  trap 'rm -rf "$out"' EXIT
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
step() { echo "wheel_check: == $*"; }
fail() { echo "wheel_check: FAILED: $*" >&2; exit 1; }

step "clean copy of $root"
src="$out/src"
mkdir -p "$src"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # tracked (less those deleted in the working tree) and untracked files that git does not ignore
  (cd "$root" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -f "$f" ]] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf -) | tar -C "$src" -xf -
else
  tar -C "$root" --exclude=./build --exclude=./dist --exclude='*.egg-info' --exclude=__pycache__ \
    --exclude=.git --exclude=.tox --exclude='.venv*' -cf - . | tar -C "$src" -xf -
fi
[[ -f "$src/pyproject.toml" && -d "$src/csrc" ]] || fail "the copy has no pyproject.toml or csrc/"

step "wheel (pip wheel, isolated build)"
"$python" -m pip wheel --no-deps -q -w "$out/wheel" "$src"
wheel="$(ls "$out"/wheel/*.whl)"
echo "wheel_check: $(basename "$wheel")"

step "sdist (setuptools build_meta in a build venv)"
"$python" -m venv "$out/buildenv"
"$out/buildenv/bin/python" -m pip install -q "setuptools>=68"
if ! (cd "$src" && "$out/buildenv/bin/python" -c \
  "import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])" "$out/sdist") \
  >"$out/sdist.log" 2>&1; then
  cat "$out/sdist.log"
  fail "building the sdist"
fi
sdist="$(ls "$out"/sdist/*.tar.gz)"
echo "wheel_check: $(basename "$sdist")"

step "wheel from the sdist"
"$python" -m pip wheel --no-deps -q -w "$out/wheel-from-sdist" "$sdist"
wheel2="$(ls "$out"/wheel-from-sdist/*.whl)"

step "compare the two wheels; csrc/ at impl/ops/csrc/"
"$python" - "$wheel" "$wheel2" "$sdist" "$src/csrc" <<'PY'
import hashlib, sys, tarfile, zipfile
from pathlib import Path

direct, from_sdist, sdist, csrc = sys.argv[1:]

def files(path):
    with zipfile.ZipFile(path) as z:
        return {n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist() if not n.endswith("/")}

a, b = files(direct), files(from_sdist)
if a != b:
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    differ = sorted(n for n in a.keys() & b.keys() if a[n] != b[n])
    sys.exit(f"the wheels differ: only in the direct wheel {only_a}, only in the sdist's {only_b}, contents {differ}")
sources = sorted(p.name for p in Path(csrc).iterdir() if p.is_file())
missing = [s for s in sources if f"impl/ops/csrc/{s}" not in a]
if not sources or missing:
    sys.exit(f"csrc/ files missing from the wheel at impl/ops/csrc/: {missing or 'csrc/ is empty'}")
with tarfile.open(sdist) as t:
    in_sdist = {Path(*Path(m.name).parts[1:]).as_posix() for m in t.getmembers() if m.isfile()}
missing = [s for s in sources if f"csrc/{s}" not in in_sdist]
if missing:
    sys.exit(f"csrc/ files missing from the sdist: {missing}")
print(f"wheel_check: OK: both wheels hold the same {len(a)} files; csrc/ ({', '.join(sources)}) "
      "is in the sdist and at impl/ops/csrc/ in the wheel")
PY

step "fresh venv: $torch_req and the wheel"
venv="$out/venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q "$torch_req" "$wheel"

run="$out/run"  # outside the checkout: neither it nor the copy is on sys.path
mkdir -p "$run"
cd "$run"
"$venv/bin/python" - <<'PY'
import sysconfig
from pathlib import Path

import dstest
import impl
from impl.ops import _build

site = Path(sysconfig.get_paths()["purelib"]).resolve()
where = {
    "dstest.__file__": Path(dstest.__file__).resolve(),
    "impl.__file__": Path(impl.__file__).resolve(),
    "impl.ops._build.source_dir()": _build.source_dir().resolve(),
}
for name, path in where.items():
    print(f"wheel_check: {name} = {path}")
    assert path.is_relative_to(site), f"{name} is {path}, not in the venv's site-packages {site}"
assert where["impl.ops._build.source_dir()"] == site / "impl" / "ops" / "csrc"
print("wheel_check: OK: dstest, impl and the kernel sources come from the venv's site-packages")
PY

step "dstest (the main job) from the wheel venv, fresh extension cache"
start=$(date +%s)
status=0
DSTEST_EXT_DIR="$out/ext" "$venv/bin/dstest" --junit "$out/dstest.xml" || status=$?
echo "wheel_check: dstest exited $status after $(( $(date +%s) - start )) s"
[[ $status == 0 ]] || fail "dstest from the wheel venv exited $status"
ls "$out"/ext/*/dstest_impl_ops*.so >/dev/null 2>&1 || fail "dstest ran but built no extension in $out/ext"

step "editable install of the copy: the sources are found in its csrc/"
"$venv/bin/python" -m pip install -q --no-deps -e "$src"
"$venv/bin/python" - "$src" <<'PY'
import sys
from pathlib import Path

import impl
from impl.ops import _build

src = Path(sys.argv[1]).resolve()
assert Path(impl.__file__).resolve().is_relative_to(src), impl.__file__
found = _build.source_dir().resolve()
assert found == src / "csrc", f"the editable install's sources are {found}, not {src / 'csrc'}"
print(f"wheel_check: OK: editable install finds the sources at {found}")
PY

echo "wheel_check: OK"
