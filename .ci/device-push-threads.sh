# Graph replay of oneshot's push kernel at other block sizes beside this tree's, under MPS:
# `device-push-threads.sh ROUNDS THREADS...`. Each variant is this tree with kPushThreads
# (native/cuda/oneshot.cu) set to THREADS, in /tmp/.pushTHREADS; device-ab.sh builds and benches
# them ("after" is this tree), taking turns round by round, at 1 KiB to 256 KiB on a fresh daemon.
here=$(pwd)
rounds=$1
shift
trees=(.)
for threads in "$@"; do
  tree=/tmp/.push$threads
  rm -rf "$tree" && mkdir -p "$tree" || exit 1
  tar -C "$here" --exclude=./.whl --exclude=./build --exclude=./.git -cf - . | tar -C "$tree" -xf - || exit 1
  sed -i "s/^constexpr int kPushThreads = kThreads;/constexpr int kPushThreads = $threads;/" "$tree/native/cuda/oneshot.cu"
  grep -q "^constexpr int kPushThreads = $threads;" "$tree/native/cuda/oneshot.cu" ||
    { echo "oneshot.cu has no 'constexpr int kPushThreads = kThreads;' to change"; exit 1; }
  trees+=("$tree")
done
bash "$here/.ci/device-ab.sh" "$rounds" "${trees[@]}" -- --device cuda --world-size 2 --graph \
  --sizes 1KiB,4KiB,16KiB,64KiB,256KiB --paths oneshot --no-baseline
