#!/usr/bin/env bash
# DeepSpeed's own unit tests twice: on DeepSpeed's harness (a process pool per test) and on dstest's warm
# process world (-p dstest.compat.deepspeed); then a per-item table of verdicts and times.
#
#   bash ci/deepspeed_upstream.sh DEEPSPEED_CHECKOUT [OUT_DIR] [TEST_PATH ...]
#
# DEEPSPEED_CHECKOUT is a checkout of github.com/deepspeedai/DeepSpeed (its tests/ are not in the wheel).
# The Python that runs it needs deepspeed, dstest and pytest<8.4 (DeepSpeed's requirements-dev.txt pins
# it: its DistributedFixture does not register as a fixture on pytest 8.4 and later). Environment:
# PYTHON (default python), LOCAL_SIZE (the harness's device count on CPU, default 4), DS_UNITTEST_TIMEOUT
# (per test, default 300 s), RUNS ("harness plugin" by default; one of them to run only that side), WARM
# (1: the plugin side runs as a developer re-running files does, with --dstest-warm, so that one warm server
# serves every path; its first run is cold, starts the server, and counts; at the end the warm servers of
# DSTEST_WARM_DIR are stopped).
set -uo pipefail
checkout=$(cd "${1:?usage: deepspeed_upstream.sh DEEPSPEED_CHECKOUT [OUT_DIR] [TEST_PATH ...]}" && pwd)
out=$(mkdir -p "${2:-deepspeed-upstream}" && cd "${2:-deepspeed-upstream}" && pwd)
shift $(( $# >= 2 ? 2 : $# ))
paths=("$@")
if [ ${#paths[@]} -eq 0 ]; then
  paths=(unit/comm unit/runtime/test_ds_config_dict.py unit/runtime/zero unit/v1/zero)
fi
python=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} DS_UNITTEST_TIMEOUT=${DS_UNITTEST_TIMEOUT:-300}
cd "$checkout/tests"
for p in "${paths[@]}"; do  # each path on both sides back to back, so that both see the same load
  name=$(echo "$p" | tr '/.' '__')
  for run in ${RUNS:-harness plugin}; do
    start=$(date +%s.%N)
    if [ "$run" = harness ]; then
      LOCAL_SIZE=${LOCAL_SIZE:-4} "$python" -m pytest -p no:dstest -p no:cacheprovider -q --continue-on-collection-errors \
        --junitxml="$out/$run-$name.xml" "$p" > "$out/$run-$name.log" 2>&1
    else
      warm=()
      if [ "${WARM:-}" = 1 ]; then warm=(--dstest-warm); fi
      "$python" -m pytest -p dstest.compat.deepspeed -p no:cacheprovider -q --continue-on-collection-errors \
        "${warm[@]}" --junitxml="$out/$run-$name.xml" "$p" > "$out/$run-$name.log" 2>&1
    fi
    rc=$?
    end=$(date +%s.%N)
    echo "$run $p rc=$rc wall=$("$python" -c "print(round($end - $start, 1))")s" | tee -a "$out/walls.txt"
  done
done
if [ "${WARM:-}" = 1 ]; then
  "$python" -m dstest.pytest.warm --stop
fi
"$python" "$here/upstream_compare.py" "$out" harness | tee "$out/table.md"
