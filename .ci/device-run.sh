export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
(time NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e . ) 2>&1 | tail -5
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
python3 -m pytest -v -p no:cacheprovider -rs --durations=0 "$@" 2>&1 | tee "${OUT:-/tmp}/pytest.log" | grep -v PASSED | tail -150
exit "${PIPESTATUS[0]}"
