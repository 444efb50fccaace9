"""Where a profiled eager all-reduce's host time goes: `python .ci/profile-summary.py PROFILE...`,
each PROFILE py-spy's raw output (collapsed stacks, `--native`) of .ci/profile-eager.py's rank 0.
Only stacks inside the timed loop count; each sample goes to the code that ran it: the first frame
from the leaf up that belongs to a known library or Python package (libc and the interpreter's
own frames go to whoever called them). Prints each owner's share of the loop's samples, the
functions most of them ran in, and nodecomm's C++ functions with what they call. py-spy names
nodecomm's frames by source file and line where the build keeps its symbols (.ci/device-profile.sh
builds its trees so: RelWithDebInfo, unstripped), and by the module otherwise."""

import collections
import pathlib
import re
import sys

# Frame "name (where)": a library file, or a source file:line, for native frames; path:line for
# Python ones.
FRAME = re.compile(r"^(?P<name>.*) \((?P<where>[^()]*)\)$")
# nodecomm's native sources by file name: the torch backend's, and the rest (the _native module).
NATIVE = pathlib.Path(__file__).resolve().parent.parent / "native"
C10D_SOURCES = {path.name for path in (NATIVE / "c10d").iterdir()}
NATIVE_SOURCES = {
    path.name for path in NATIVE.rglob("*") if path.suffix in {".h", ".cpp", ".cu", ".cuh"}
} - C10D_SOURCES


def source_pattern(names: set[str]) -> str:
    return r"^(" + "|".join(re.escape(name) for name in sorted(names)) + r"):\d+$"


OWNERS = [  # (owner, pattern on `where`), native libraries first
    ("CUDA driver", r"libcuda\.so"),
    ("CUDA runtime", r"libcudart"),
    ("nodecomm native (_native)", r"_native\.|" + source_pattern(NATIVE_SOURCES)),
    ("nodecomm C++ backend (_c10d)", r"_c10d\.|" + source_pattern(C10D_SOURCES)),
    ("torch C++ (libtorch, c10)", r"libtorch|libc10|_C\.cpython"),
    ("nodecomm Python", r"^(nodecomm|client|distributed|service)/|/nodecomm/"),
    ("torch Python", r"^torch/|/torch/"),
]
PASS_THROUGH = r"libc\.so|libpthread|ld-linux|libpython|libstdc|^$|python3|intrin\.h:"


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


def summary(path: str) -> None:
    shares: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()  # nodecomm's C++ functions, inclusive
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        # The timed loop's calls: frames below main's lambda (profile-eager.py's `call`).
        lambdas = [i for i, f in enumerate(frames) if re.search(r"<lambda> \(profile-eager\.py", f)]
        if not lambdas:
            continue
        shares[owner_of(frames[lambdas[0] + 1 :])] += int(count)
        leaves[leaf_of(frames[lambdas[0] + 1 :])] += int(count)
        functions = set()
        for frame in frames[lambdas[0] + 1 :]:
            match = FRAME.match(frame)
            if match and owner_of([frame]).startswith("nodecomm") and ".py" not in match.group("where"):
                name = re.sub(r"\(.*$", "", match.group("name"))  # one entry with or without its signature
                functions.add(f"{name[:70]} ({match.group('where').split(':')[0]})")
        for function in functions:
            ours[function] += int(count)
    total = sum(shares.values())
    print(f"{path}: {total} samples in the timed loop")
    for owner, samples in shares.most_common():
        print(f"  {owner:34s} {samples / max(total, 1) * 100:5.1f} %")
    print("  the functions most samples ran in:")
    for leaf, samples in leaves.most_common(12):
        print(f"    {samples / max(total, 1) * 100:5.1f} %  {leaf}")
    print("  nodecomm's C++ functions, with what they call:")
    for function, samples in ours.most_common(14):
        print(f"    {samples / max(total, 1) * 100:5.1f} %  {function}")


if __name__ == "__main__":
    for profile in sys.argv[1:]:
        summary(profile)
