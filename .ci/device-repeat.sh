#!/usr/bin/env bash
# Runs one pytest selection N times in a row on the device (default 3), each under a deadline;
# a run past it leaves py-spy stacks of every Python process and the daemons' logs in $OUT, then
# is killed. Every run's verdict is printed: what a flaky GPU test needs before it is called fixed.
#   .ci/device-repeat.sh RUNS DEADLINE_S PYTEST_ARGS...
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
runs=$1 deadline=$2
shift 2
out=${OUT:-/tmp/device-repeat}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit 1
(time NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e . ) 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
failed=0
for run in $(seq "$runs"); do
    base=/tmp/repeat-$run
    start=$SECONDS
    setsid python3 -m pytest -q -p no:cacheprovider --basetemp "$base" "$@" > "$out/run-$run.log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && (( SECONDS - start < deadline )); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        for p in $(pgrep -f python3); do
            [ "$p" = "$$" ] || py-spy dump --pid "$p" >> "$out/run-$run.stacks" 2>&1
        done
        find "$base" -name '*.log' -exec sh -c 'for f; do echo "== $f"; tail -200 "$f"; done' _ {} + > "$out/run-$run.daemon-logs" 2>&1
        kill -9 -- -"$pid"
        echo "run $run: HUNG past ${deadline}s (stacks in run-$run.stacks)"
        failed=1
    else
        wait "$pid"
        rc=$?
        echo "run $run: rc=$rc in $((SECONDS - start))s: $(tail -1 "$out/run-$run.log")"
        (( rc == 0 )) || { failed=1; grep -E "^(FAILED|ERROR)" "$out/run-$run.log"; find "$base" -name '*.log' -exec sh -c 'for f; do echo "== $f"; tail -200 "$f"; done' _ {} + > "$out/run-$run.daemon-logs" 2>&1; }
    fi
done
exit "$failed"
