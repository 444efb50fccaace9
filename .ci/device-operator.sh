# What the docs show from a GPU machine, one GPU or several: nodecomm topo and status (with a live
# CUDA group), the CUDA calibration's table and plot, the all-reduce bench through that calibrated
# daemon (so that `auto` is the calibrated dispatch, with its regret), and the top-k exchange's
# bench beside gather-then-slice. Writes them under $OUT. Ranks land on cuda:{rank % gpus}; where
# ranks share a GPU they run under MPS so that their kernels run at once instead of time-slicing.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
NODECOMM_CUDA_ARCHS=90 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
nodecomm() { python3 -c "import sys; from nodecomm.tools.cli import main; sys.exit(main())" "$@"; }
set -o pipefail
failed=0
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
world=$(( gpus > 1 ? gpus : 2 ))
socket=/tmp/nodecommd/nodecomm.sock
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog
  nvidia-cuda-mps-control -d && echo "MPS started"
}
start_daemon() {
  python3 -m nodecomm.service --socket $socket --metrics-address 127.0.0.1:9464 --allow-shared-devices true \
    --state-dir /tmp/nodecommd/state >> /tmp/daemon.log 2>&1 &
  daemon=$!
  sleep 3
}
[ "$gpus" = 1 ] && start_mps
nodecomm topo | tee "$OUT/topo.txt"
start_daemon

# A CUDA group held open while status and the metrics endpoint look at it.
cat > /tmp/status_demo.py <<'PY'
import multiprocessing as mp, sys, time
def rank(r, world, socket):
    import torch, nodecomm
    device = f"cuda:{r % torch.cuda.device_count()}"
    torch.cuda.set_device(device)
    with nodecomm.connect("status-demo", r, world, device=device, socket=socket, timeout=60) as comm:
        comm.all_reduce(torch.ones(1024, device=device)); torch.cuda.synchronize(); time.sleep(12)
if __name__ == "__main__":
    world = int(sys.argv[1])
    ps = [mp.get_context("spawn").Process(target=rank, args=(r, world, sys.argv[2])) for r in range(world)]
    [p.start() for p in ps]; [p.join() for p in ps]
PY
python3 /tmp/status_demo.py $world $socket &
holder=$!
sleep 9
nodecomm --socket $socket status | tee "$OUT/status.txt"
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9464/metrics').read().decode())" > "$OUT/metrics.txt"
wait $holder

timeout 150 python3 -c "import sys; from nodecomm.tools.cli import main; sys.exit(main())" --socket $socket \
  calibrate --device cuda --world-size $world --plot "$OUT/calibration-cuda.png" | tee "$OUT/calibration-cuda.txt" || failed=1
timeout 180 python3 -c "import sys; from nodecomm.tools.cli import main; sys.exit(main())" --socket $socket \
  bench --device cuda --world-size $world --graph | tee "$OUT/bench-w$world-graph.txt" || failed=1
kill $daemon; wait $daemon 2>/dev/null
for w in $(printf '%s\n' ${TOPK_WORLDS:-$world 4 8} | sort -nu); do
  [ "$w" -gt "$gpus" ] && [ ! -e /tmp/mps/control ] && start_mps
  timeout 80 python3 -c "import sys; from nodecomm.tools.cli import main; sys.exit(main())" bench --op topk --device cuda \
    --world-size $w --rows 64,256,1024,2048 --topk 2048 --iterations 20 | tee -a "$OUT/bench-topk.txt" || failed=1
done
[ -e /tmp/mps/control ] && echo quit | nvidia-cuda-mps-control
tail -20 /tmp/daemon.log
exit $failed
