"""The native module's build (CMakeLists.txt, native/CMakeLists.txt): which GPUs the CUDA kernels
are compiled for, and that a reinstall of unchanged sources compiles nothing although pip gives
every isolated build a fresh environment (and scikit-build-core then clears the build folder's
CMakeFiles/ and CMakeCache.txt)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pybind11
import pytest

REPOSITORY = Path(__file__).resolve().parent.parent


def _pybind11_environment(at: Path) -> Path:
    """A copy of pybind11 at `at`, as pip's build environment of one install holds it: its CMake
    folder."""
    shutil.copytree(Path(pybind11.__file__).parent, at / "pybind11")
    return at / "pybind11" / "share" / "cmake" / "pybind11"


def _configure(build: Path, pybind11_dir: Path, env: dict[str, str]) -> str:
    configured = subprocess.run(
        ["cmake", "-S", str(REPOSITORY), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
         f"-Dpybind11_DIR={pybind11_dir}", f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert configured.returncode == 0, configured.stdout + configured.stderr
    return configured.stdout


def _fake_nvidia_smi(folder: Path, capabilities: list[str], env: dict[str, str]) -> dict[str, str]:
    """`env` with an nvidia-smi that reports GPUs of these compute capabilities."""
    folder.mkdir()
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo {c}\n" for c in capabilities))
    smi.chmod(0o755)
    return {**env, "PATH": f"{folder}:{env['PATH']}"}


needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(), reason="needs nvcc"
)


@needs_nvcc
def test_cuda_kernels_are_compiled_for_the_gpus_present_else_for_every_target(tmp_path):
    pybind11_dir = _pybind11_environment(tmp_path / "env")
    env = {k: v for k, v in os.environ.items() if k not in ("NODECOMM_CUDA_ARCHS", "NODECOMM_CPU_ONLY")}
    present = _configure(
        tmp_path / "gpus", pybind11_dir, _fake_nvidia_smi(tmp_path / "smi", ["9.0", "9.0", "8.9"], env)
    )
    assert "architectures 90;89 (the GPUs of this machine;" in present, present
    none = _configure(tmp_path / "none", pybind11_dir, _fake_nvidia_smi(tmp_path / "no-smi", [], env))
    assert "architectures 89;90;120 (no GPU visible, so every target)" in none, none
    asked = _configure(tmp_path / "asked", pybind11_dir, {**env, "NODECOMM_CUDA_ARCHS": "120"})
    assert "architectures 120 (NODECOMM_CUDA_ARCHS)" in asked, asked


def test_a_rebuild_in_a_fresh_build_environment_compiles_nothing(tmp_path):
    """The CPU module (the CUDA sources take the same path, at minutes each): built once, then
    configured again as scikit-build-core does for the next `pip install` (cache and CMakeFiles/
    gone, pybind11 at another place), ninja finds nothing to do."""
    env = {**os.environ, "NODECOMM_CPU_ONLY": "1"}
    build = tmp_path / "build"
    _configure(build, _pybind11_environment(tmp_path / "first"), env)
    built = subprocess.run(["ninja", "-C", str(build)], capture_output=True, text=True, env=env, timeout=1200)
    assert built.returncode == 0, built.stdout + built.stderr
    assert list(build.glob("native/_native*.so")), built.stdout

    (build / "CMakeCache.txt").unlink()
    shutil.rmtree(build / "CMakeFiles")
    shutil.rmtree(tmp_path / "first")
    _configure(build, _pybind11_environment(tmp_path / "second"), env)
    again = subprocess.run(
        ["ninja", "-C", str(build), "-d", "explain"], capture_output=True, text=True, env=env, timeout=1200
    )
    assert again.returncode == 0, again.stdout + again.stderr
    compiled = [line for line in again.stdout.splitlines() if line.lstrip().startswith("[")]
    assert compiled == [] and "no work to do" in again.stdout, again.stdout + again.stderr
