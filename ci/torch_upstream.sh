#!/usr/bin/env bash
# Test files of torch's own distributed suite, twice: as upstream runs them (plain pytest; the bases spawn a
# process per rank per test) and with dstest's plugin (-p dstest.compat.torch); then a per-path table of
# verdicts and times, and every item whose verdict differs.
#
#   bash ci/torch_upstream.sh TORCH_TESTS_DIR [OUT_DIR] [TEST_PATH ...]
#
# TORCH_TESTS_DIR holds torch's test files (test/distributed/... of github.com/pytorch/pytorch; they are
# not in torch's wheel); TEST_PATHs are relative to it. The Python that runs it needs torch, dstest and
# expecttest. Environment: PYTHON (default python), RUNS ("upstream plugin" by default; one of them to run
# only that side; "unchecked" runs the plugin with --dstest-unchecked, on torch's own gloo groups: with
# RUNS="plugin unchecked" the table compares dstest's checked groups with gloo), WARM (1: the plugin side
# runs as a developer re-running files does, with --dstest-warm, every file from TORCH_TESTS_DIR so that one
# warm server serves them all, with the file's directory as rootdir for upstream's test ids; its first run
# is cold and starts the server, and counts; at the end the warm servers of DSTEST_WARM_DIR are stopped).
# The sides run one after the other on the same machine.
set -uo pipefail
root=$(cd "${1:?usage: torch_upstream.sh TORCH_TESTS_DIR [OUT_DIR] [TEST_PATH ...]}" && pwd)
out=$(mkdir -p "${2:-torch-upstream}" && cd "${2:-torch-upstream}" && pwd)
shift $(( $# >= 2 ? 2 : $# ))
paths=("$@")
if [ ${#paths[@]} -eq 0 ]; then
  paths=(test/distributed/tensor/test_dtensor_testbase.py)
fi
python=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)
for p in "${paths[@]}"; do  # each path on both sides back to back, so that both see the same load
  name=$(echo "$p" | tr '/.' '__')
  cd "$root/$(dirname "$p")"  # as torch's run_test.py does: each file from its own directory
  for run in ${RUNS:-upstream plugin}; do
    extra=()
    if [ "$run" = unchecked ]; then extra=(--dstest-unchecked); fi
    start=$(date +%s.%N)
    if [ "$run" = upstream ]; then
      "$python" -m pytest -p no:dstest -p no:cacheprovider -q --continue-on-collection-errors \
        --junitxml="$out/$run-$name.xml" "$(basename "$p")" > "$out/$run-$name.log" 2>&1
    elif [ "${WARM:-}" = 1 ]; then
      (cd "$root" && "$python" -m pytest -p dstest.compat.torch -p no:cacheprovider -q --continue-on-collection-errors \
        --dstest-warm "${extra[@]}" --rootdir="$(dirname "$p")" --junitxml="$out/$run-$name.xml" "$p") > "$out/$run-$name.log" 2>&1
    else
      "$python" -m pytest -p dstest.compat.torch -p no:cacheprovider -q --continue-on-collection-errors \
        "${extra[@]}" --junitxml="$out/$run-$name.xml" "$(basename "$p")" > "$out/$run-$name.log" 2>&1
    fi
    rc=$?
    end=$(date +%s.%N)
    echo "$run $p rc=$rc wall=$("$python" -c "print(round($end - $start, 1))")s" | tee -a "$out/walls.txt"
  done
done
if [ "${WARM:-}" = 1 ]; then
  "$python" -m dstest.pytest.warm --stop
fi
case " ${RUNS:-upstream plugin} " in
  *" upstream "*) baseline=upstream ;;
  *) baseline=unchecked ;;
esac
"$python" "$here/upstream_compare.py" "$out" "$baseline" | tee "$out/table.md"
