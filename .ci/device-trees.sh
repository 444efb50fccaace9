# Sourced by device-eager.sh and device-profile.sh with their TREE arguments: the device
# environment, the carried wheels in /tmp/site, each TREE built once into /tmp/nc-NAME (NAME as in
# device-ab.sh: "after" for `.`; a build device-ab.sh left there is kept), `names` and `here` set,
# MPS started for ranks that share GPU 0, and /tmp the working directory. With NC_SYMBOLS=1 the
# builds go to /tmp/nc-NAME-symbols instead, RelWithDebInfo and unstripped, so that py-spy and
# profile-summary.py name nodecomm's frames (`suffix` is then "-symbols").
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# The ranks share GPU 0: the private daemon they start must allow it.
export NODECOMM_ALLOW_SHARED_DEVICES=true
here=$(pwd)
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
names=()
flags=() suffix=
[ -n "$NC_SYMBOLS" ] && flags=(-C install.strip=false -C cmake.build-type=RelWithDebInfo) suffix=-symbols
for tree in "$@"; do
  if [ "$tree" = . ]; then name=after; else name=$(basename "$tree" | sed 's/^\.//'); fi
  names+=("$name")
  [ -d "/tmp/nc-$name$suffix" ] || (cd "$tree" && NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation \
    --no-deps --no-compile "${flags[@]}" --target "/tmp/nc-$name$suffix" . 2>&1 | tail -3) &
done
wait
python3 -m pip uninstall -q -y nodecomm 2>/dev/null
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS started"
cd /tmp || exit 1
