"""Where a profiled eager all-reduce's host time goes: `python .ci/profile-summary.py PROFILE...`,
each PROFILE py-spy's raw output (collapsed stacks, `--native`) of .ci/profile-eager.py's rank 0.
Only stacks inside the timed loop count; each sample goes to the code that ran it: the first frame
from the leaf up that belongs to a known library or Python package (libc and the interpreter's
own frames go to whoever called them). Prints each owner's share of the loop's samples, and the
functions most of them ran in. With `--maps MAPS` (the profiled process's /proc/self/maps, which
profile-eager.py writes where NC_MAPS says) nodecomm's own frames, which py-spy names by address
only, are named by addr2line, and each nodecomm C++ function's inclusive share is printed too."""

import bisect
import collections
import re
import subprocess
import sys

# Frame "name (where)": a library file for native frames, path:line for Python ones.
FRAME = re.compile(r"^(?P<name>.*) \((?P<where>[^()]*)\)$")
OWNERS = [  # (owner, pattern on `where`), native libraries first
    ("CUDA driver", r"libcuda\.so"),
    ("CUDA runtime", r"libcudart"),
    ("nodecomm native (_native)", r"_native\."),
    ("nodecomm C++ backend (_c10d)", r"_c10d\."),
    ("torch C++ (libtorch, c10)", r"libtorch|libc10|_C\.cpython"),
    ("nodecomm Python", r"^(nodecomm|client|distributed|service)/|/nodecomm/"),
    ("torch Python", r"^torch/|/torch/"),
]
PASS_THROUGH = r"libc\.so|libpthread|ld-linux|libpython|libstdc|^$|python3"


def owner_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        match = FRAME.match(frame)
        where = match.group("where") if match else ""
        for owner, pattern in OWNERS:
            if re.search(pattern, where):
                return owner
        if not re.search(PASS_THROUGH, where) and not where.startswith("0x"):
            if ".py:" in where:
                return "Python (other)"
            return f"other ({where})"
    return "interpreter / libc"


def leaf_of(frames: list[str]) -> str:
    """The function a sample's time is spent in: the innermost frame that is not libc's or the
    interpreter's own."""
    for frame in reversed(frames):
        match = FRAME.match(frame)
        if match and not re.search(PASS_THROUGH, match.group("where")):
            return f"{match.group('name')[:60]} ({match.group('where').rsplit('/', 1)[-1][:30]})"
    return "interpreter / libc"


class Symbols:
    """nodecomm's native frames ("0xADDR (_c10d...)") named through the process's maps and
    addr2line (a build installed unstripped: `-C install.strip=false`)."""

    def __init__(self, maps: str):
        self.spans = []  # (start, end, file offset, path) of nodecomm's modules
        for line in open(maps):
            parts = line.split()
            if len(parts) >= 6 and re.search(r"/nodecomm/_(native|c10d)\.", parts[5]):
                start, end = (int(value, 16) for value in parts[0].split("-"))
                self.spans.append((start, end, int(parts[2], 16), parts[5]))
        self.spans.sort()
        self.names: dict[str, str] = {}

    def resolve(self, stacks: list[list[str]]) -> None:
        wanted: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
        for frames in stacks:
            for frame in frames:
                match = FRAME.match(frame)
                if match and match.group("name").startswith("0x") and frame not in self.names:
                    address = int(match.group("name"), 16)
                    i = bisect.bisect_right(self.spans, (address, float("inf"))) - 1
                    if i >= 0 and self.spans[i][0] <= address < self.spans[i][1]:
                        start, _, offset, module = self.spans[i]
                        wanted[module].append((frame, address - start + offset))
                        self.names[frame] = frame
        for module, frames in wanted.items():
            out = subprocess.run(
                ["addr2line", "-f", "-C", "-e", module, *(hex(offset) for _, offset in frames)],
                capture_output=True, text=True, check=False,
            ).stdout.splitlines()
            for (frame, _), name in zip(frames, out[0::2], strict=False):
                self.names[frame] = f"{name[:70]} ({module.rsplit('/', 1)[-1][:12]})"

    def name(self, frame: str) -> str:
        return self.names.get(frame, frame)


def summary(path: str, symbols: Symbols | None) -> None:
    shares: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    samples = []
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        samples.append((stack.split(";"), int(count)))
    if symbols:
        symbols.resolve([frames for frames, _ in samples])
    for frames, count in samples:
        if symbols:
            frames = [symbols.name(frame) for frame in frames]
        # The timed loop's calls: frames below main's lambda (profile-eager.py's `call`).
        lambdas = [i for i, f in enumerate(frames) if re.search(r"<lambda> \(profile-eager\.py", f)]
        if not lambdas:
            continue
        shares[owner_of(frames[lambdas[0] + 1 :])] += count
        leaves[leaf_of(frames[lambdas[0] + 1 :])] += count
        for name in set(frames[lambdas[0] + 1 :]):
            if symbols and ("(_native." in name or "(_c10d." in name):
                inclusive[name] += count
    total = sum(shares.values())
    print(f"{path}: {total} samples in the timed loop")
    for owner, count in shares.most_common():
        print(f"  {owner:34s} {count / max(total, 1) * 100:5.1f} %")
    print("  the functions most samples ran in:")
    for leaf, count in leaves.most_common(12):
        print(f"    {count / max(total, 1) * 100:5.1f} %  {leaf}")
    if inclusive:
        print("  nodecomm's C++ functions, with what they call (inclusive):")
        for name, count in inclusive.most_common(16):
            print(f"    {count / max(total, 1) * 100:5.1f} %  {name}")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    symbols = None
    if arguments[:1] == ["--maps"]:
        symbols, arguments = Symbols(arguments[1]), arguments[2:]
    for profile in arguments:
        summary(profile, symbols)
