# What the operator docs show from a GPU machine: nodecomm topo and status (with a live CUDA
# group), the CUDA calibration's table and plot, and the top-k exchange's bench beside NCCL
# gather-then-slice. Writes them under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
nodecomm() { python3 -c "import sys; from nodecomm.client.cli import main; sys.exit(main())" "$@"; }
nodecomm topo | tee "$OUT/topo.txt"; nodecomm topo --json > "$OUT/topo.json"
socket=/tmp/nodecommd/nodecomm.sock
python3 -m nodecomm.service.server --socket $socket --metrics-address 127.0.0.1:9464 --allow-shared-devices true \
  --state-dir /tmp/nodecommd/state > "$OUT/daemon.log" 2>&1 &
daemon=$!
sleep 3
# A CUDA group of two ranks held open while status looks at it.
python3 - "$socket" <<'PY' &
import multiprocessing as mp, sys, time
def rank(r, socket):
    import torch, nodecomm
    torch.cuda.set_device(0)
    with nodecomm.connect("status-demo", r, 2, device="cuda:0", socket=socket, timeout=60) as comm:
        comm.all_reduce(torch.ones(1024, device="cuda:0")); torch.cuda.synchronize(); time.sleep(15)
if __name__ == "__main__":
    ps = [mp.get_context("spawn").Process(target=rank, args=(r, sys.argv[1])) for r in range(2)]
    [p.start() for p in ps]; [p.join() for p in ps]
PY
holder=$!
sleep 10
nodecomm --socket $socket status | tee "$OUT/status.txt"; nodecomm --socket $socket status --json > "$OUT/status.json"
curl -s 127.0.0.1:9464/metrics > "$OUT/metrics.txt" || python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9464/metrics').read().decode())" > "$OUT/metrics.txt"
wait $holder
# The CUDA calibration (two probe ranks sharing the GPU on one-GPU machines, under MPS so that
# their kernels run at once instead of time-slicing), its table and plot.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog
nvidia-cuda-mps-control -d && echo "MPS started"
kill $daemon; wait $daemon 2>/dev/null
python3 -m nodecomm.service.server --socket $socket --metrics-address 127.0.0.1:9464 --allow-shared-devices true \
  --state-dir /tmp/nodecommd/state >> "$OUT/daemon.log" 2>&1 &
daemon=$!
sleep 3
timeout 300 python3 -c "import sys; from nodecomm.client.cli import main; sys.exit(main())" --socket $socket \
  calibrate --device cuda --world-size "${CALIBRATE_WORLD:-2}" --plot "$OUT/calibration-cuda.png" | tee "$OUT/calibration-cuda.txt"
timeout 240 python3 -c "import sys; from nodecomm.client.cli import main; sys.exit(main())" bench --op topk --device cuda \
  --world-size "${TOPK_WORLD:-2}" --rows 64,256,1024,2048 --topk 2048 --iterations 20 | tee "$OUT/bench-topk.txt"
kill $daemon
echo quit | nvidia-cuda-mps-control
true
