# Issue 59's bounds on the device machine for this tree beside an earlier one, in one run, ranks
# sharing GPU 0 under MPS: `device-bounds.sh BEFORE [ROUNDS]` (BEFORE as in device-ab.sh). Each
# round runs .ci/ab-percall.py on CUDA (NC_QUICK=1) for this tree and BEFORE, taking turns at going
# first, into $OUT/percall.txt; then the graph replay of oneshot and auto at 1, 4 and 16 KiB for
# both, each on a fresh private daemon, into $OUT/graph.txt. A round not begun by NC_BUDGET seconds
# (default 420) is skipped, so that the replays still run within the tool's limit.
before=$1 rounds=${2:-2}
. "$(dirname "$0")/device-trees.sh" "$before" .
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/percall.txt"
started=$SECONDS
order=("${names[@]}")
for round in $(seq "$rounds"); do
  [ $((SECONDS - started)) -lt "${NC_BUDGET:-420}" ] || { echo "round $round skipped: budget spent" | tee -a "$OUT/percall.txt"; break; }
  for name in "${order[@]}"; do
    export PYTHONPATH=/tmp/nc-$name:/tmp/site XDG_CACHE_HOME=/tmp/cache-$name-$round
    [ "$name" = after ] && unset NC_BEFORE || export NC_BEFORE=1
    echo "== $name, round $round" | tee -a "$OUT/percall.txt"
    rm -f /tmp/percall.store
    (for rank in 0 1; do OMP_NUM_THREADS=1 NC_QUICK=1 timeout 150 python3 "$here/.ci/ab-percall.py" $rank 2 /tmp/percall.store cuda & done
      wait) 2>&1 | tee -a "$OUT/percall.txt"
  done
  order=("${order[1]}" "${order[0]}")
done
unset NC_BEFORE
for name in "${names[@]}"; do
  echo "== $name, graph replay" | tee -a "$OUT/graph.txt"
  PYTHONPATH=/tmp/nc-$name:/tmp/site timeout 120 python3 "$here/.ci/nodecomm-cli.py" bench --device cuda --world-size 2 \
    --graph --sizes 1KiB,4KiB,16KiB --paths oneshot,auto --no-baseline 2>&1 | tee -a "$OUT/graph.txt"
done
echo quit | nvidia-cuda-mps-control
true
