# The GPU bench of two trees in one run on the device machine: the tree at $1 (an earlier commit,
# extracted with git archive) against this one, alternating $2 rounds under MPS; the rest of the
# arguments go to `nodecomm bench`. Each round's tables land in $OUT/ab-{before,after}-ROUND.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
before=$1 rounds=$2
shift 2
for name in before after; do
  tree=$([ $name = before ] && echo "$before" || echo .)
  (cd "$tree" && NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps --no-compile \
    --target /tmp/nc-$name . 2>&1 | tail -3)
done
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS started"
# An editable install of this tree (device-run.sh's) and the tree's own nodecomm/ folder in the
# working directory would both shadow PYTHONPATH: each tree must load its own build.
python3 -m pip uninstall -q -y nodecomm 2>/dev/null
cd /tmp || exit 1
for name in before after; do
  PYTHONPATH=/tmp/nc-$name:/tmp/site python3 -c "import nodecomm, sys; print('$name:', nodecomm.__file__); \
    sys.exit(not nodecomm.__file__.startswith('/tmp/nc-$name/'))" || exit 1
done
for round in $(seq "$rounds"); do
  for name in before after; do
    echo "== $name, round $round"
    PYTHONPATH=/tmp/nc-$name:/tmp/site timeout 200 python3 -c \
      "import sys; from nodecomm.client.cli import main; sys.exit(main())" bench "$@" | tee "$OUT/ab-$name-$round.txt"
  done
done
echo quit | nvidia-cuda-mps-control
true
