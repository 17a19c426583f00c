"""Building the CUDA C++ kernels with nvcc (no GPU needed): once per source, headers and
architecture, with a clear error where nvcc is missing."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from qerl.errors import QuantizationError
from qerl.kernels import cuda_build, nvfp4_gemm, nvfp4_gemv
from tests.conftest import missing


@pytest.mark.slow
@pytest.mark.parametrize(("source", "arch"), [(nvfp4_gemv.SOURCE, "90"),
                                              (nvfp4_gemm.SOURCE, nvfp4_gemm.ARCHS["90"])])
def test_builds_once_per_source_and_arch(tmp_path, source, arch):
    if cuda_build.nvcc() is None:
        missing("nvcc", "not on PATH (the CUDA image and CI have it)")
    lib = cuda_build.build(source, arch, tmp_path)
    assert lib.exists() and lib.suffix == ".so" and source.stem in lib.name
    stamp = lib.stat().st_mtime_ns
    assert cuda_build.build(source, arch, tmp_path) == lib and lib.stat().st_mtime_ns == stamp


def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch):
    """The kernels share nvfp4_decode.cuh: a build is named by it too."""
    if cuda_build.nvcc() is None:
        missing("nvcc", "not on PATH (the CUDA image and CI have it)")
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.cu").write_text('#include "k.cuh"\nextern "C" int f() { return K; }\n')
    (src / "k.cuh").write_text("#define K 1\n")
    first = cuda_build.build(src / "k.cu", "90", tmp_path / "out")
    (src / "k.cuh").write_text("#define K 2\n")
    assert cuda_build.build(src / "k.cu", "90", tmp_path / "out") != first


def test_build_without_nvcc_names_the_cause(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_build, "nvcc", lambda: None)
    with pytest.raises(QuantizationError, match="nvcc not found"):
        cuda_build.build(nvfp4_gemv.SOURCE, "90", tmp_path)


def test_a_failed_build_shows_the_compiler_error(tmp_path):
    if cuda_build.nvcc() is None:
        missing("nvcc", "not on PATH (the CUDA image and CI have it)")
    bad = tmp_path / "bad.cu"
    bad.write_text("this is not C++\n")
    with pytest.raises(QuantizationError, match="building bad.cu failed"):
        cuda_build.build(bad, "90", tmp_path / "out")


def test_nvcc_is_found_on_cuda_home(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "nvcc"
    fake.write_text("#!/bin/sh\n")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert cuda_build.nvcc() == str(fake)
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert cuda_build.nvcc() == shutil.which("nvcc")


C_TYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong}


def c_parameters(source, function: str) -> list[str]:
    """The parameter types of ``function``'s definition in a .cu file, as written."""
    text = source.read_text()
    start = text.index(f"int {function}(") + len(f"int {function}(")
    return [" ".join(p.split()[:-1]) for p in text[start:text.index(")", start)].split(",")]


@pytest.mark.parametrize(("module", "function"), [(nvfp4_gemm, "qerl_nvfp4_gemm"),
                                                  (nvfp4_gemv, "qerl_nvfp4_gemv")])
def test_the_ctypes_signatures_are_the_kernels(module, function):
    """Each parameter as ctypes passes it, read against the C definition: an argument too
    many for ARGTYPES goes through as a C int, and a 64-bit stream handle cut to 32 bits
    crashed the process (a GEMM branch that added a parameter)."""
    params = c_parameters(module.SOURCE, function)
    assert len(params) == len(module.ARGTYPES), params
    for written, given in zip(params, module.ARGTYPES, strict=True):
        if "*" in written:
            assert given is ctypes.c_void_p or issubclass(given, ctypes._Pointer), written
        else:
            assert given is C_TYPES[written], written
