# The GPU bench of several trees in one run on the device machine, alternating them round by round
# under MPS: `device-ab.sh ROUNDS TREE... -- BENCH-ARGS`. A TREE is a folder holding an earlier
# tree (git archive of a commit) or `.` for this one; each round's tables land in
# $OUT/ab-NAME-ROUND.txt, NAME being the folder's name without its dot ("after" for `.`).
here=$(pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
rounds=$1
shift
trees=() names=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  trees+=("$1")
  if [ "$1" = . ]; then names+=(after); else names+=("$(basename "$1" | sed 's/^\.//')"); fi
  shift
done
shift
# A build device-trees.sh left in /tmp/nc-NAME (an earlier call on this machine) is kept.
for i in "${!trees[@]}"; do
  [ -d "/tmp/nc-${names[$i]}" ] || (cd "${trees[$i]}" && NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps --no-compile \
    --target "/tmp/nc-${names[$i]}" . 2>&1 | tail -3) &
done
wait
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS started"
# An editable install of this tree (device-run.sh's) and the tree's own nodecomm/ folder in the
# working directory would both shadow PYTHONPATH: each tree must load its own build.
python3 -m pip uninstall -q -y nodecomm 2>/dev/null
cd /tmp || exit 1
for name in "${names[@]}"; do
  PYTHONPATH=/tmp/nc-$name:/tmp/site python3 -c "import nodecomm, sys; print('$name:', nodecomm.__file__); \
    sys.exit(not nodecomm.__file__.startswith('/tmp/nc-$name/'))" || exit 1
done
for round in $(seq "$rounds"); do
  for name in "${names[@]}"; do
    echo "== $name, round $round"
    PYTHONPATH=/tmp/nc-$name:/tmp/site timeout 200 python3 "$here/.ci/nodecomm-cli.py" bench "$@" | tee "$OUT/ab-$name-$round.txt"
  done
done
echo quit | nvidia-cuda-mps-control
true
