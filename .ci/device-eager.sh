# Eager per-call figures of several trees in one run on the device machine, ranks sharing GPU 0
# under MPS: `device-eager.sh TREE...` (TREE as in device-ab.sh, which may have built it already
# in /tmp/nc-NAME). Per tree: .ci/ab-percall.py on CUDA and on the CPU (world 2), and the eager
# bench of oneshot, auto, dist.all_reduce (torch) and inplace at 1 KiB .. 4 MiB (CUDA) and to
# 256 KiB with gloo's row (CPU); into $OUT/eager-NAME.txt. Each tree's private daemons keep their
# calibration and live moves in a cache directory of that tree's own: a run on a warm machine starts
# from nothing another run kept.
. "$(dirname "$0")/device-trees.sh" "$@"
for name in "${names[@]}"; do
  export PYTHONPATH=/tmp/nc-$name:/tmp/site XDG_CACHE_HOME=/tmp/cache-$name-$$
  [ "$name" = after ] && unset NC_BEFORE || export NC_BEFORE=1
  for device in cuda cpu; do
    echo "== $name, per call, $device" | tee -a "$OUT/eager-$name.txt"
    rm -f /tmp/percall.store
    (for rank in 0 1; do timeout 200 python3 "$here/.ci/ab-percall.py" $rank 2 /tmp/percall.store $device & done; wait) 2>&1 |
      tee -a "$OUT/eager-$name.txt"
  done
  echo "== $name, eager bench" | tee -a "$OUT/eager-$name.txt"
  timeout 200 python3 "$here/.ci/nodecomm-cli.py" bench --device cuda --world-size 2 \
    --paths oneshot,auto,torch,inplace --sizes 1KiB,16KiB,256KiB,1MiB,4MiB 2>&1 | tee -a "$OUT/eager-$name.txt"
  echo "== $name, CPU bench" | tee -a "$OUT/eager-$name.txt"
  timeout 200 python3 "$here/.ci/nodecomm-cli.py" bench --device cpu --world-size 2 \
    --paths oneshot,auto,torch,inplace,gloo --sizes 1KiB,16KiB,256KiB 2>&1 | tee -a "$OUT/eager-$name.txt"
done
echo quit | nvidia-cuda-mps-control
true
