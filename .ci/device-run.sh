export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
(time NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e . ) 2>&1 | tail -5
# NC_MPS=1: the ranks share GPU 0 under MPS (worlds past 4 time-slice it without); the fault tests
# run without, where one context's fault cannot reach the others.
if [ -n "$NC_MPS" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS started"
fi
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
# The run's own deadline (NC_TIMEOUT seconds, default 540: under the tool's 600 s limit), so that a
# hung test still returns its log: pytest is stopped, then the ranks and daemons it left (into a
# file, not a pipe, which those would hold open). NC_LOG names the log, for calls that run several.
log=${OUT:-/tmp}/${NC_LOG:-pytest}.log
timeout -k 10 "${NC_TIMEOUT:-540}" python3 -m pytest -v -p no:cacheprovider -rs --durations=0 "$@" > "$log" 2>&1
rc=$?
[ "$rc" = 124 ] && echo "pytest stopped after ${NC_TIMEOUT:-540} s" && pkill -9 -f "multiprocessing|nodecommd|nodecomm.service"
grep -v PASSED "$log" | tail -150
[ -n "$NC_MPS" ] && echo quit | nvidia-cuda-mps-control
exit "$rc"
