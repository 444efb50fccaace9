# Where an eager CUDA all-reduce's host time goes, per tree: `[NC_ROWS="comm dist async slot"]
# device-profile.sh TREE...` (TREE as in device-ab.sh; rows as in .ci/profile-eager.py). Two ranks share GPU 0 under MPS; rank 0 runs .ci/profile-eager.py under
# `py-spy record --native` (collapsed stacks, native frames included) for comm.all_reduce and
# dist.all_reduce, summed up on the machine by .ci/profile-summary.py into $OUT/profiles.txt (the
# raw stacks run to tens of MB, more than a run brings back). py-spy pauses the rank at every
# sample: the shares are what counts, not the profiled rank's time per call.
NC_SYMBOLS=1 . "$(dirname "$0")/device-trees.sh" "$@"
for name in "${names[@]}"; do
  export PYTHONPATH=/tmp/nc-$name$suffix:/tmp/site
  [ "$name" = after ] && unset NC_BEFORE || export NC_BEFORE=1
  for row in ${NC_ROWS:-comm dist}; do
    echo "== $name $row"
    rm -f /tmp/profile.store
    timeout 90 python3 "$here/.ci/profile-eager.py" 1 2 /tmp/profile.store $row 20000 &
    timeout 90 /tmp/site/bin/py-spy record --native --rate 500 --format raw -o "/tmp/prof-$name-$row.txt" -- \
      python3 "$here/.ci/profile-eager.py" 0 2 /tmp/profile.store $row 20000 2>&1 | grep -v "^py-spy> You"
    wait
    python3 "$here/.ci/profile-summary.py" "/tmp/prof-$name-$row.txt" | tee -a "$OUT/profiles.txt"
  done
done
echo quit | nvidia-cuda-mps-control
true
