"""The README's Layout is the tree: every file it names exists, and every source file of the
packages and of native/ is named there (or lies in a folder it names, as bindings/ does)."""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = re.compile(r"\.(py|h|cuh|cu|cpp|proto)$")
NAMED = re.compile(r"[\w./]+?\.(?:py|h|cuh|cu|cpp|proto)(?:/\.cu)?|[\w]+/(?=\s|,|$)")


def layout() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Layout") :]
    return section[section.index("```") + 3 : section.index("```", section.index("```") + 3)]


def named_paths() -> set[str]:
    """Each name resolved against the top-level folder its line sits under (a name with a slash
    may also be from the root: native/shm.h on a client/ line)."""
    named, folder = set(), ""
    for line in layout().splitlines():
        top = re.match(r"([\w./]+/)\s", line)
        if top:
            folder, line = top.group(1), line[top.end() :]
        for written in NAMED.findall(line):  # "topk.h/.cu" names topk.h and topk.cu
            pair = written.endswith("/.cu")
            for name in [written[: -len("/.cu")], written[: -len(".h/.cu")] + ".cu"] if pair else [written]:
                candidates = [folder + name, name] if "/" in name else [folder + name]
                found = [c for c in candidates if (ROOT / c).exists()]
                named.add(os.path.normpath(found[0] if found else folder + name) + ("/" if name.endswith("/") else ""))
    return named


def test_every_file_the_layout_names_exists():
    missing = sorted(p for p in named_paths() if not (ROOT / p).exists())
    assert missing == [], f"the README's Layout names files the tree lacks: {missing}"


def test_every_source_file_is_in_the_layout():
    named = named_paths()
    folders = tuple(p for p in named if p.endswith("/"))
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    sources = [
        path
        for path in tracked.split()
        if path.split("/")[0]
        in {"nodecomm", "service", "client", "tools", "distributed", "integrations", "native", "proto"}
        and SOURCES.search(path)
        and not path.endswith(("__init__.py", "_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
    ]
    unnamed = sorted(p for p in sources if p not in named and not p.startswith(folders))
    assert unnamed == [], f"source files the README's Layout does not name: {unnamed}"


def test_every_file_the_call_flow_walks_through_exists():
    """docs/call-flow.md names files with their folder, except where a step names one again."""
    text = (ROOT / "docs" / "call-flow.md").read_text()
    named = set(re.findall(r"`([\w/]+\.(?:py|h|cuh|cu|cpp|proto))`", text))
    with_folder = {Path(n).name for n in named if "/" in n}
    missing = sorted(
        n for n in named if not (ROOT / n).exists() and not (ROOT / "native/cuda" / n).exists() and n not in with_folder
    )
    assert missing == [], f"docs/call-flow.md names files the tree lacks: {missing}"


def test_no_module_or_header_outgrows_its_house():
    """A Python module of the packages holds at most 550 lines and a native header at most 350: past
    that a file holds more than one idea (split it by its parts, as service/ and client/ are)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    limits = {".py": 550, ".h": 350, ".cuh": 350}
    packages = {"nodecomm", "service", "client", "tools", "distributed", "integrations", "native"}
    over = []
    for path in tracked.split():
        limit = limits.get(Path(path).suffix)
        if limit is None or path.split("/")[0] not in packages or path.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        lines = len((ROOT / path).read_text().splitlines())
        if lines > limit:
            over.append(f"{path}: {lines} lines (at most {limit})")
    assert over == [], f"files past their house size: {over}"
