# Compressed wires on the device machine: the bench's compressed rows beside lossless (world 2,
# CUDA graphs, under MPS so that the two ranks' kernels run concurrently on the one GPU), then the
# error table on CUDA groups (unless DTYPE names another dtype than float32). Arguments: the
# bench's sizes (default below).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
nodecomm() { python3 -c "import sys; from nodecomm.tools.cli import main; sys.exit(main())" "$@"; }
sizes=${1:-16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB}
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS started"
dtype=${DTYPE:-float32}
timeout 300 nodecomm bench --device cuda --world-size 2 --graph --no-baseline --sizes "$sizes" --dtype $dtype \
  --paths oneshot,twoshot,dma --wire int8,fp8 --json "$OUT/bench-wires-$dtype.json" | tee "$OUT/bench-wires-$dtype.txt"
echo quit | nvidia-cuda-mps-control
[ "$dtype" = float32 ] || exit 0
timeout 240 nodecomm bench --op wire-error --device cuda --worlds 2,4,8 | tee "$OUT/wire-error-cuda.md"
