"""Compile the NVFP4 Triton kernels for a GPU architecture (no GPU needed) and print, as
JSON, each launch's shared memory, local-memory traffic (register spills), its byte-wide
and 16-byte asynchronous global loads and its tensor-core instructions:

    python tests/kernels/compile_kernels.py          # every launch, sm_90
    python tests/kernels/compile_kernels.py 80 89    # every launch, for those cards

Run without TRITON_INTERPRET: the interpreter accepts programs the compiler rejects. On an
architecture before sm_89 the kernels read the scales as bytes (compute_capability), as
they do on such a card.

Arguments are specialised as at a real launch on Qwen2.5 shapes: pointers 16-byte aligned
and integer sizes and strides divisible by 16 (Triton's own specialisation)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qerl.kernels import compute_capability
from qerl.kernels import nvfp4_triton as fused_kernels

POINTERS = {"fwd": ("x_ptr", "words_ptr", "scale_ptr", "global_scale_ptr", "bias_ptr",
                    "out_ptr"),
            "bwd": ("dy_ptr", "words_ptr", "scale_ptr", "global_scale_ptr", "out_ptr"),
            "dequant": ("words_ptr", "scale_ptr", "global_scale_ptr", "out_ptr")}
TYPES = {"words_ptr": "*i32", "global_scale_ptr": "*fp32", "out_ptr": "*fp32"}
SCALARS = {"fwd": ("M", "N", "K", "stride_xm", "stride_pt", "stride_sn", "stride_os",
                   "stride_om"),
           "bwd": ("M", "N", "K", "stride_dym", "stride_pt", "stride_sn", "stride_os",
                   "stride_om"),
           "dequant": ("N", "K", "stride_pt", "stride_sn", "stride_on")}
KERNELS = {"fwd": fused_kernels.nvfp4_fwd_kernel, "bwd": fused_kernels.nvfp4_bwd_kernel,
           "dequant": fused_kernels.nvfp4_dequant_kernel}
# nvfp4_triton.dequantize's launch (its tile is no LaunchConfig).
DEQUANT_TILE = {"BLOCK_N": 32, "PAIRS": 8}


def _sass(cubin: bytes) -> str:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump), "--dump-sass", f.name], capture_output=True,
                              text=True, check=True).stdout


def compile_config(op: str, cfg: fused_kernels.LaunchConfig | None, dtype: str,
                   arch: int = 90) -> dict:
    """Compile ``op``'s kernel (fwd, bwd: launched as ``cfg``; dequant: as
    nvfp4_triton.dequantize launches it) for ``dtype`` activations on ``arch``."""
    kernel = KERNELS[op]
    fp8 = arch >= compute_capability.FP8_CONVERSION_FROM
    if op == "dequant":
        constexprs = {"FP8": fp8, **DEQUANT_TILE}
        options = {"num_warps": 4}
    else:
        constexprs = {"ASM": True, "BF16": dtype == "bf16",
                      "PRE": 2.0 ** 64 if dtype == "bf16" else 1.0,
                      "POST": 2.0 ** 62 if dtype == "bf16" else 2.0 ** 14, "FP8": fp8,
                      "SPLIT_K": cfg.split_k, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_c,
                      **({"HAS_BIAS": True, "EVEN_K": True, "PAIRS": cfg.pairs} if op == "fwd"
                         else {})}
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    types = {**TYPES, "scale_ptr": "*fp8e4nv" if fp8 else "*u8"}
    if op == "dequant":
        types["out_ptr"] = f"*{dtype}"
    signature = {p: types.get(p, f"*{dtype}") for p in POINTERS[op]}
    signature |= dict.fromkeys(SCALARS[op], "i32") | dict.fromkeys(constexprs, "constexpr")
    divisible = [*POINTERS[op], *(s for s in SCALARS[op] if s != "M")]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    sass = _sass(compiled.asm["cubin"])
    loads = re.findall(r"LDG\.E(\.[A-Z0-9]+)*", sass)
    return {"op": op, "dtype": dtype, "arch": arch, **(cfg.__dict__ if cfg else {}),
            "shared": compiled.metadata.shared,
            "spills": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
            # fp8 scales are single bytes: 2 loads per 16-byte chunk of codes.
            "byte_loads": sum(1 for width in loads if width == ".U8"),
            "wide_async_loads": len(re.findall(r"LDGSTS\.E\.BYPASS\.128", sass)),
            "mma": len(re.findall(r"\bH[G]?MMA\b", sass))}


def all_configs() -> set[tuple[str, fused_kernels.LaunchConfig]]:
    configs = set()
    for op in ("fwd", "bwd"):
        for m in (1, 17, 32, 64):  # 64: a path named beyond the crossover
            # One split-K and one unsplit config per tile shape.
            for n, k in ((37888, 3584), (3584, 18944)):
                configs.add((op, fused_kernels.launch_config(op, m, n, k, num_sms=132)))
    return configs


def compile_all(arch: int) -> list[dict]:
    """Every launch configuration of the forward and backward kernels, and the dequantize
    kernel, for each activation dtype."""
    launches = [*sorted(all_configs(), key=str), ("dequant", None)]
    return [compile_config(op, cfg, dtype, arch) for op, cfg in launches
            for dtype in ("bf16", "fp16")]


if __name__ == "__main__":
    print(json.dumps([r for arch in map(int, sys.argv[1:] or ["90"])
                      for r in compile_all(arch)]))
