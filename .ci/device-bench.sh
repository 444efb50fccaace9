# GPU bench tables on the device machine; with several ranks per GPU it runs them under MPS so
# that their kernels run concurrently (without MPS, time-slicing costs ~2 ms per barrier).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS started"
fi
for spec in "$@"; do
  world=${spec%%:*}; mode=${spec##*:}
  flag=""; [ "$mode" = graph ] && flag="--graph"
  timeout 280 python3 -c "import sys; from nodecomm.tools.cli import main; sys.exit(main())" bench --device cuda \
    --world-size "$world" $flag --json "$OUT/bench-w$world-$mode.json" | tee "$OUT/bench-w$world-$mode.txt"
done
[ "${MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control
true
