# Issue 38 on one GPU, ranks sharing it under MPS: a job of two ranks all-reduces eagerly for 30 s
# through its private daemon (empty state, the user's cache in /tmp/fm/cache), then a fresh private
# daemon (another empty state directory, the same cache) serves `nodecomm bench --graph`: auto
# against every path per size, and the table it started from. Into $OUT/first-minute.txt.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export NODECOMM_ALLOW_SHARED_DEVICES=true XDG_CACHE_HOME=/tmp/fm/cache
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -c "import nodecomm.tools.cli" 2>/dev/null || NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e .
sizes=16KiB,1MiB,16MiB,64MiB,256MiB
bytes=16384,1048576,16777216,67108864,268435456
rm -rf /tmp/fm && mkdir -p -m 700 /tmp/fm /tmp/fm/cache /tmp/fm/run1 /tmp/fm/d2
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
log=${OUT:-/tmp}/first-minute.txt
echo "== the job: 30 s of eager all-reduces at $sizes" | tee -a "$log"
(for rank in 0 1; do NODECOMM_STATE_DIR=/tmp/fm/state1 XDG_RUNTIME_DIR=/tmp/fm/run1 timeout 200 \
  python3 .ci/first-minute-job.py $rank 30 $bytes & done; wait) 2>&1 | tee -a "$log"
sleep 3  # the job's daemon leaves after its grace
ls -l /tmp/fm/cache/nodecomm 2>&1 | tee -a "$log"
socket=/tmp/fm/d2/nodecomm.sock
python3 -m nodecomm.service --socket $socket --private true --private-grace-seconds 600 \
  --state-dir /tmp/fm/state2 --cache-dir /tmp/fm/cache/nodecomm --metrics-address off --log-level WARNING &
daemon=$!
for _ in $(seq 100); do [ -S $socket ] && break; sleep 0.1; done
cli() { timeout 300 python3 -c "import sys; from nodecomm.tools.cli import main; sys.exit(main())" --socket $socket "$@"; }
echo "== a fresh daemon's table (empty state, the same cache)" | tee -a "$log"
cli thresholds --device cuda 2>&1 | tee -a "$log"
echo "== nodecomm bench --device cuda --world-size 2 --graph against it" | tee -a "$log"
cli bench --device cuda --world-size 2 --graph --paths oneshot,twoshot,dma,auto --sizes $sizes 2>&1 | tee -a "$log"
kill $daemon
echo quit | nvidia-cuda-mps-control
true
