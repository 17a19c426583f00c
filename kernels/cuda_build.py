"""Build the CUDA C++ kernels (nvfp4_gemv.cu, nvfp4_gemm.cu) with nvcc on first use.

A build lands in ``$QERL_CACHE`` (default ``~/.cache/qerl``)/kernels, named by a hash of the
source, the headers beside it, the architecture and nvcc's version, written atomically (a
concurrent build leaves one whole file); a failed build says why. ``python -m
qerl.kernels.cuda_build 90 100`` builds every kernel ahead of use (no GPU needed), as the
image does.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from qerl.errors import QuantizationError
from qerl.kernels import compute_capability

HERE = Path(__file__).parent
# Each source and the architectures it is built for: None, every one asked for; else a map
# from a device's architecture to the target (wgmma needs the architecture-specific sm_90a).
SOURCES = {"nvfp4_gemv.cu": None, "nvfp4_gemm.cu": {"90": "90a"}}


def cache_dir() -> Path:
    return Path(os.environ.get("QERL_CACHE", Path.home() / ".cache" / "qerl")) / "kernels"


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build(source: Path, arch: str, out_dir: Path | None = None) -> Path:
    """Compile ``source`` for ``arch`` (e.g. "90", or "90a" for Hopper-only instructions)
    into a shared library; return its path (an existing build of the same source, headers,
    arch, flags and nvcc is reused)."""
    compiler = nvcc()
    if compiler is None:
        raise QuantizationError("nvcc not found (set CUDA_HOME or put it on PATH): the "
                                "CUDA NVFP4 kernels are built on first use")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout
    flags = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
             f"-gencode=arch=compute_{arch},code=sm_{arch}", *torch_flags()]
    # nvcc adds the flags of these variables to every command: they make another build too.
    extra = [os.environ.get(v, "") for v in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")]
    # torch's version too: the operators are built against its headers and libraries.
    digest = hashlib.sha256(source.read_bytes() + arch.encode() + version.encode()
                            + torch.__version__.encode() + " ".join(flags + extra).encode())
    for header in sorted(source.parent.glob("*.cuh")):
        digest.update(header.read_bytes())
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{source.stem}_sm{arch}_{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        target = Path(tmp) / lib.name
        cmd = [compiler, *flags, "-o", str(target), str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise QuantizationError(f"building {source.name} failed ({' '.join(cmd)}):\n"
                                    f"{done.stderr[-3000:]}")
        os.replace(target, lib)
    return lib


def torch_flags() -> list[str]:
    """Compile against the running torch's headers and link its libraries (the kernels are
    its operators, torch_op.cuh), with its C++ ABI; c10's CUDA library too where torch has
    one (torch's current stream). The libraries are found where torch is, as they are when
    it is imported."""
    from torch.utils import cpp_extension

    libs = Path(cpp_extension.library_paths()[0])
    linked = [lib for lib in ("c10", "torch_cpu", "c10_cuda") if (libs / f"lib{lib}.so").exists()]
    return [*(f"-I{path}" for path in cpp_extension.include_paths()),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-L{libs}", *(f"-l{lib}" for lib in linked), f"-Xlinker=-rpath={libs}"]


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def target(source: Path, arch: str) -> str:
    """What ``source`` is built for on a device of ``arch`` (SOURCES)."""
    targets = SOURCES[source.name]
    return arch if targets is None else targets[arch]


def unavailable_reason(device: torch.device, source: Path,
                       why_not: Callable[[str], str | None]) -> str | None:
    """Why the kernel of ``source`` cannot run on ``device`` (None: it can, its operators
    registered and its kernels loaded on the device): not a CUDA device; else ``why_not``
    of its architecture, or a failed build, and the same of the older one the kernels are
    chosen for where QERL_KERNEL_ARCH names one (compute_capability: that card's choice,
    made here, built but not loaded: a process registers one library's operators).
    Answered once per device and QERL_KERNEL_ARCH: every launch asks."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    return _unavailable(device, source, why_not, os.environ.get(compute_capability.VARIABLE))


@functools.cache
def _unavailable(device: torch.device, source: Path, why_not: Callable[[str], str | None],
                 named: str | None) -> str | None:
    own, chosen = arch_of(device), compute_capability.chosen_for(device)
    for arch in dict.fromkeys((own, chosen)):
        reason = why_not(arch) or _failure(source, target(source, arch), arch == own)
        if reason:
            return reason
    return _failure(source, target(source, own), True, index_of(device))


@functools.cache
def _failure(source: Path, arch: str, load: bool, index: int | None = None) -> str | None:
    """The error of building the library (with ``load``, opening it; with ``index``, loading
    its kernels on that device), None if there is none."""
    try:
        if index is not None:
            loaded(source, arch, index)
        elif load:
            library(source, arch)
        else:
            build(source, arch)
    except (QuantizationError, OSError, RuntimeError) as e:
        return str(e)
    return None


def index_of(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


_OPENED: dict[str, str] = {}  # each source's library opened in this process: its arch


@functools.cache
def library(source: Path, arch: str) -> ctypes.CDLL:
    """The built library of ``source`` for ``arch``, opened: loading it registers its
    operators' CUDA implementations (torch_op.cuh), so a process opens one architecture's
    library of a source. Each library also exports ``<stem>_init(device)`` (loads its
    kernels on a device, before any graph capture: a first launch inside a capture must not
    be the one that loads the module) and ``<stem>_error_string(error)``, both returning
    cudaError_t codes."""
    opened = _OPENED.get(source.stem, arch)
    if opened != arch:
        raise QuantizationError(f"{source.name} is loaded for sm_{opened} in this process; "
                                f"its operators cannot be registered again for sm_{arch} "
                                "(one GPU architecture a process)")
    lib = ctypes.CDLL(str(build(source, arch)))
    _OPENED[source.stem] = arch
    init, error = getattr(lib, f"qerl_{source.stem}_init"), _error_string(lib, source)
    init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
    error.argtypes, error.restype = [ctypes.c_int], ctypes.c_char_p
    return lib


def _error_string(lib: ctypes.CDLL, source: Path):
    return getattr(lib, f"qerl_{source.stem}_error_string")


@functools.cache
def loaded(source: Path, arch: str, index: int) -> ctypes.CDLL:
    """``library`` with its kernels loaded on cuda:``index``."""
    lib = library(source, arch)
    error = getattr(lib, f"qerl_{source.stem}_init")(index)
    if error:
        raise QuantizationError(f"loading {source.name} on cuda:{index} failed: "
                                f"{_error_string(lib, source)(error).decode()}")
    return lib


def supported_archs() -> set[str]:
    """The compute capabilities the nvcc found compiles for (``nvcc --list-gpu-arch``)."""
    compiler = nvcc()
    if compiler is None:
        raise QuantizationError("nvcc not found (set CUDA_HOME or put it on PATH)")
    listed = subprocess.run([compiler, "--list-gpu-arch"], capture_output=True, text=True,
                            check=True).stdout
    return {line.removeprefix("compute_") for line in listed.split()}


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m qerl.kernels.cuda_build",
                                     description="Build the CUDA NVFP4 kernels ahead of use.")
    parser.add_argument("archs", nargs="+", help="compute capabilities, e.g. 90 100")
    parser.add_argument("--skip-unsupported", action="store_true",
                        help="build for those of ARCHS this nvcc supports and name the others "
                             "(a device of theirs builds on first use, or takes the Triton "
                             "kernels where it cannot)")
    args = parser.parse_args(argv)
    archs = args.archs
    if args.skip_unsupported:
        supported = supported_archs()
        skipped = [a for a in archs if a not in supported]
        archs = [a for a in archs if a in supported]
        if skipped:
            print(f"not built: sm_{', sm_'.join(skipped)} (this nvcc does not compile for "
                  f"them: nvcc --list-gpu-arch)")
    for arch in archs:
        for name, targets in SOURCES.items():
            if targets is None or arch in targets:
                print(build(HERE / name, arch if targets is None else targets[arch]))


if __name__ == "__main__":
    main()
