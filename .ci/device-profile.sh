# Where an eager CUDA all-reduce's host time goes, per tree: `device-profile.sh TREE...` (TREE as
# in device-ab.sh). Two ranks share GPU 0 under MPS; rank 0 runs .ci/profile-eager.py under
# `py-spy record --native` (collapsed stacks, native frames included) for comm.all_reduce and
# dist.all_reduce, summed up on the machine by .ci/profile-summary.py into $OUT/profiles.txt (the
# raw stacks run to tens of MB, more than a run brings back). py-spy pauses the rank at every
# sample: the shares are what counts, not the profiled rank's time per call.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export NODECOMM_ALLOW_SHARED_DEVICES=true
here=$(pwd)
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
names=()
for tree in "$@"; do
  if [ "$tree" = . ]; then name=after; else name=$(basename "$tree" | sed 's/^\.//'); fi
  names+=("$name")
  [ -d "/tmp/nc-$name" ] || (cd "$tree" && NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps \
    --no-compile --target "/tmp/nc-$name" . 2>&1 | tail -3) &
done
wait
python3 -m pip uninstall -q -y nodecomm 2>/dev/null
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS started"
cd /tmp || exit 1
for name in "${names[@]}"; do
  export PYTHONPATH=/tmp/nc-$name:/tmp/site
  [ "$name" = after ] && unset NC_BEFORE || export NC_BEFORE=1
  for row in comm dist; do
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
