#!/usr/bin/env bash
# Mutation testing of dstest's checkers (docs/checking-the-checkers.md): mutmut changes the named modules one
# small edit at a time (a comparison flipped, a constant changed, a call dropped...) and runs a fast selection
# of tests against every such mutant; a mutant that no test fails "survived": either the tests miss a change
# of behaviour, or the edit changes none (an equivalent mutant). Long (minutes to tens of minutes a module on
# one core): not run in CI.
#
#   bash ci/mutation.sh MODULE...     e.g. bash ci/mutation.sh dstest/worlds/core/matching.py dstest/worlds/core/c10d.py
#
# Environment:
#   TESTS    the test files run against each mutant, space-separated (default: the checker's own tests, by
#            module, in tests_for below; a module not listed there needs TESTS)
#   WORK     the directory to run in (default: a new one under /tmp). Give an earlier run's WORK again to
#            resume it: mutmut keeps its results in WORK/mutants and tests only what it has not decided
#   AGAIN    with WORK of an earlier run: 1 tests again only the mutants that survived it (after new tests)
#   PYTHON   the Python with dstest, its test extra and mutmut 3 (pip install mutmut); default python
#   WORKERS  mutmut's --max-children (default 1: the project's machines have two shared cores)
#
# The run happens in a copy of the work tree (the files git tracks or would track), so that editing the
# checkout meanwhile changes nothing; pyproject.toml's [tool.mutmut] is rewritten there for MODULE... At the
# end it prints the score per module and writes every surviving mutant's diff to WORK/survivors.txt.
set -euo pipefail
main() {  # all of it in a function: bash reads a script as it runs, and the file may be edited meanwhile
if [ $# -eq 0 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  return 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python}
workers=${WORKERS:-1}

tests_for() {  # the fast tests that exercise one checker's module directly
  case "$1" in
    dstest/worlds/core/matching.py | dstest/worlds/core/c10d.py)
      echo tests/test_checker_properties_matching.py tests/test_core_mutants.py tests/test_core.py ;;
    dstest/replicas/*.py) echo tests/test_checker_properties_replicas.py tests/test_replicas.py tests/test_replicas_mutants.py ;;
    dstest/crosscheck.py | dstest/compare.py)  # compare.py: crosscheck's comparison, moved there as it was
      echo tests/test_checker_properties_crosscheck.py tests/test_crosscheck.py tests/test_crosscheck_mutants.py ;;
    dstest/worlds/core/faults.py)
      echo tests/test_checker_properties_faults.py tests/test_faults.py tests/test_faults_mutants.py ;;
    dstest/worlds/process/state_watch.py) echo tests/test_checker_properties_state_watch.py tests/test_state_watch.py ;;
  esac
}

for m in "$@"; do
  [ -f "$root/$m" ] || { echo "mutation.sh: no module $m (give paths from the repository root)" >&2; exit 2; }
done
if [ -n "${TESTS:-}" ]; then
  read -r -a tests <<< "$TESTS"
else
  tests=()
  for m in "$@"; do
    picked=$(tests_for "$m")
    [ -n "$picked" ] || { echo "mutation.sh: no default tests for $m: set TESTS" >&2; exit 2; }
    for t in $picked; do
      [ -f "$root/$t" ] && [[ " ${tests[*]-} " != *" $t "* ]] && tests+=("$t")
    done
  done
fi
[ ${#tests[@]} -gt 0 ] || { echo "mutation.sh: none of the tests exist" >&2; exit 2; }

work=${WORK:-$(mktemp -d /tmp/dstest-mutation.XXXXXX)}
mkdir -p "$work"
# The work tree as it is now (a resumed run too: mutmut then tests the new tests against its mutants)
(cd "$root" && git ls-files -co --exclude-standard -z | tar --null -T - --ignore-failed-read -cf -) | tar -xf - -C "$work"
"$python" - "$work/pyproject.toml" "$#" "$@" "${tests[@]}" <<'PY'
import re, sys
path, n = sys.argv[1], int(sys.argv[2])
modules, tests = sys.argv[3 : 3 + n], sys.argv[3 + n :]
q = lambda xs: "[" + ", ".join(f'"{x}"' for x in xs) + "]"
section = (
    "[tool.mutmut]\n"
    'source_paths = ["dstest/"]\n'
    f"only_mutate = {q(modules)}\n"
    'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x", "--hypothesis-profile=mutation"]\n'
    f"pytest_add_cli_args_test_selection = {q(tests)}\n\n"
)
text = open(path).read()
text, count = re.subn(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", section, text)
if not count:
    text += "\n" + section
open(path, "w").write(text)
PY

# The properties' examples for mutants: the same for every mutant (derandomize, no database), so that a
# score does not move between runs by chance; and not shrunk: a mutant is killed by its first failing
# example, and shrinking one under a mutant that breaks every example takes minutes.
if ! grep -q '"mutation"' "$work/tests/conftest.py"; then
  cat >> "$work/tests/conftest.py" <<'PY'

from hypothesis import Phase  # noqa: E402  (added by ci/mutation.sh, in its copy of the work tree only)

settings.register_profile(
    "mutation", deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate]
)
PY
fi

echo "mutation.sh: mutating $* in $work, tests: ${tests[*]}"
cd "$work"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
status=0
again=()
if [ -n "${AGAIN:-}" ] && [ -d mutants ]; then  # only the mutants an earlier run left alive
  read -r -a again <<< "$("$python" -m mutmut results | awk '/: (survived|no tests|timeout)$/ {sub(":", "", $1); print $1}' | tr '\n' ' ')"
  echo "mutation.sh: again: ${#again[@]} mutants"
fi
nice -n 10 "$python" -m mutmut run --max-children "$workers" "${again[@]}" || status=$?

# The score per module, from mutmut's verdict of every mutant (names: dotted module path, then the function).
"$python" -m mutmut results --all true > results.txt
"$python" - results.txt "$@" <<'PY'
import collections, re, sys
counts = collections.defaultdict(collections.Counter)
modules = sys.argv[2:]
for line in open(sys.argv[1]):
    m = re.match(r"\s*(\S+): (.+)$", line)
    if not m:
        continue
    name, status = m.groups()
    module = next((p for p in modules if name.startswith(p[:-3].replace("/", ".") + ".")), "?")
    counts[module][status] += 1
print(f"\n{'module':<40} {'mutants':>8} {'killed':>7} {'timeout':>8} {'survived':>9} {'no tests':>9}  score")
for module in modules:
    c = counts[module]
    total, killed = sum(c.values()), c["killed"] + c["timeout"]
    score = f"{100 * killed / total:.1f}%" if total else "-"
    print(f"{module:<40} {total:>8} {c['killed']:>7} {c['timeout']:>8} {c['survived']:>9} {c['no tests']:>9}  {score}")
    other = {k: v for k, v in c.items() if k not in ("killed", "timeout", "survived", "no tests")}
    if other:
        print(f"{'':<40} also: {other}")
PY
: > survivors.txt
for name in $(awk '/: (survived|no tests)$/ {sub(":", "", $1); print $1}' results.txt); do
  "$python" -m mutmut show "$name" >> survivors.txt
  echo >> survivors.txt
done
echo "mutation.sh: $(grep -c '^# ' survivors.txt || true) surviving mutants (with their diffs) in $work/survivors.txt"
return $status
}
main "$@"
exit $?
