"""The engines' released source, read and never installed: the pinned wheels, downloaded once into
a cache ($NODECOMM_ENGINE_WHEELS, else ~/.cache/nodecomm-tests/engines), and what their code reads
on the custom all-reduce object, found by parsing it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("NODECOMM_ENGINE_WHEELS") or Path.home() / ".cache" / "nodecomm-tests" / "engines")


def wheel(project: str, version: str) -> Path:
    """The engine's wheel for CPython 3.11 on x86-64 Linux (whatever runs the tests: the code read
    is the same), downloaded with pip where the cache has none."""
    pattern = f"{project}-{version}-*.whl"
    found = sorted(CACHE.glob(pattern))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
             "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_34_x86_64",
             "-q", "-d", str(CACHE),
             f"{project}=={version}"],
            check=True, timeout=240,
        )  # fmt: skip
        found = sorted(CACHE.glob(pattern))
    return found[0]


@dataclass(frozen=True)
class Read:
    attribute: str
    where: str  # file:line in the wheel
    probed: bool  # the same function asks hasattr() or getattr(..., default) for it first


def slot_reads(path: Path, package: str, slot_class: tuple[str, str] | None = None) -> dict[str, list[Read]]:
    """Every attribute the package's code reads on its custom all-reduce object: on a name
    `ca_comm`, on an `.ca_comm` attribute, or on a name assigned from one, by attribute; and with
    `slot_class` (module, class name: what the slot replaces), on that class where a file other
    than its own imports it."""
    reads: dict[str, list[Read]] = defaultdict(list)
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if not (name.startswith(package + "/") and name.endswith(".py")):
                continue
            source = archive.read(name).decode("utf-8", "replace")
            tree, classes = None, set()
            if slot_class is not None and slot_class[1] in source and name != slot_class[0].replace(".", "/") + ".py":
                tree = ast.parse(source)
                classes = {
                    alias.asname or alias.name
                    for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module == slot_class[0]
                    for alias in node.names
                    if alias.name == slot_class[1]
                }
            if "ca_comm" in source or classes:
                for read in _reads(tree or ast.parse(source), name, classes):
                    reads[read.attribute].append(read)
    return dict(reads)


def _reads(tree: ast.Module, name: str, classes: set[str] = frozenset()) -> list[Read]:
    """Per function (and the module's own statements): the reads on `ca_comm`, on `.ca_comm`, and on
    names the function assigns from `.ca_comm`. A read the function only reaches for an object of
    the engine's own class (it asks isinstance() of it) is not one of the slot's."""
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    reads = []
    for scope in scopes:
        probed, found = set(), []
        body = [n for n in _own_nodes(scope)]
        aliases = {"ca_comm", *classes}
        for node in body:  # comm = <...>.ca_comm
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "ca_comm":
                aliases.update(target.id for target in node.targets if isinstance(target, ast.Name))

        def slot(node: ast.AST, aliases: set[str] = aliases) -> bool:
            return (isinstance(node, ast.Name) and node.id in aliases) or (
                isinstance(node, ast.Attribute) and node.attr == "ca_comm"
            )

        typed = any(
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
            and node.args and slot(node.args[0])
            for node in body
        )  # fmt: skip
        if typed:
            continue
        for node in body:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
                named = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
                if not slot(node.args[0]) or not isinstance(named, str):
                    continue
                if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
                    probed.add(named)
                elif node.func.id == "getattr":
                    found.append((named, node.lineno))
            elif isinstance(node, ast.Attribute) and slot(node.value):
                found.append((node.attr, node.lineno))
        reads += [Read(attribute, f"{name}:{line}", attribute in probed) for attribute, line in found]
    return reads


def _own_nodes(scope: ast.AST):
    """The nodes of `scope` outside the functions and classes nested in it."""
    for child in ast.iter_child_nodes(scope):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield child
        yield from _own_nodes(child)


def functions(path: Path, file: str, names: list[str], namespace: dict, class_name: str | None = None) -> dict:
    """The engine's own functions `names` (module-level, or methods of `class_name`), compiled from
    the wheel's `file` alone into `namespace`, which stands in for the module's other names, with
    their decorators dropped (the engines' custom-op registration): dispatch code run as released."""
    with zipfile.ZipFile(path) as archive:
        tree = ast.parse(archive.read(file).decode(), file)
    body = tree.body
    if class_name is not None:
        (owner,) = [n for n in body if isinstance(n, ast.ClassDef) and n.name == class_name]
        body = owner.body
    found = {n.name: n for n in body if isinstance(n, ast.FunctionDef) and n.name in names}
    missing = sorted(set(names) - set(found))
    assert not missing, f"{path.name}/{file} has no {class_name or 'module'} function {missing}"
    for function in found.values():
        function.decorator_list = []
    code = compile(ast.Module(body=list(found.values()), type_ignores=[]), f"{path.name}/{file}", "exec")
    exec(code, namespace)  # noqa: S102
    return {name: namespace[name] for name in names}


def method(path: Path, file: str, class_name: str, name: str, namespace: dict):
    """The engine's own `class_name.name`, compiled from the wheel's `file` alone (see functions)."""
    return functions(path, file, [name], namespace, class_name)[name]


def unpack(path: Path, files: list[str], root: Path) -> None:
    """The wheel's `files`, written under `root` as they are in the wheel."""
    with zipfile.ZipFile(path) as archive:
        for file in files:
            (root / file).parent.mkdir(parents=True, exist_ok=True)
            (root / file).write_bytes(archive.read(file))
