"""Building the CUDA C++ kernels with nvcc (no GPU needed): once per source, headers and
architecture, with a clear error where nvcc is missing."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch

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


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests open the libraries")
@pytest.mark.parametrize(("module", "arch"), [(nvfp4_gemv, "90"),
                                              (nvfp4_gemm, nvfp4_gemm.ARCHS["90"])])
def test_a_library_registers_its_operator_against_the_schema(module, arch):
    """Opening a built library registers its operator's CUDA implementation, which the
    dispatcher checks against the schema the module defined: a C++ signature that drifts
    from it fails here, on the CPU (opened lazily: torch has no CUDA here)."""
    if cuda_build.nvcc() is None:
        missing("nvcc", "not on PATH (the CUDA image and CI have it)")
    ctypes.CDLL(str(cuda_build.build(module.SOURCE, arch)), mode=os.RTLD_LAZY)
    name = f"qerl::{module.SOURCE.stem}"
    table = torch._C._dispatch_dump_table(name)
    assert "CUDA: registered at" in table and module.SOURCE.name in table, table
    assert "Meta: registered" in table, table  # the fake implementation


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests open the libraries")
def test_a_second_architectures_library_is_refused_by_name():
    """Its operators would be registered twice, which fails inside the library's loading,
    where no Python error can be raised: the second architecture is refused before."""
    if cuda_build.nvcc() is None:
        missing("nvcc", "not on PATH (the CUDA image and CI have it)")
    cuda_build.library(nvfp4_gemv.SOURCE, "90")
    with pytest.raises(QuantizationError, match="nvfp4_gemv.cu is loaded for sm_90 in this "
                                                "process.*for sm_89"):
        cuda_build.library(nvfp4_gemv.SOURCE, "89")
