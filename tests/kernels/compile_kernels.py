"""Compile the NVFP4 Triton kernels for a GPU architecture (no GPU needed) and print, as
JSON, each launch's shared memory, local-memory traffic (register spills), its byte-wide
and 16-byte asynchronous global loads and its tensor-core instructions:

    python tests/kernels/compile_kernels.py          # every launch, sm_90
    python tests/kernels/compile_kernels.py 80 89    # every launch, for those cards
    python tests/kernels/compile_kernels.py cache 80 90  # the fp8 KV cache's kernels

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

from qerl.kernels import compute_capability, decode_attention, rotary_cache
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


def compile_cache_kernels(arch: int) -> list[dict]:
    """The kernels that write and read an fp8 KV cache (its E4M3 read as fp8 from sm_89,
    else as bytes), for 16-bit queries, at Qwen2.5's head_dim 128."""
    fp8 = arch >= compute_capability.FP8_CONVERSION_FROM
    cache, scales = "*fp8e4nv" if fp8 else "*u8", {"ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    launches = [(decode_attention.decode_split_kernel, lambda dtype: {
        "q_ptr": f"*{dtype}", "k_ptr": cache, "v_ptr": cache, **scales, "pad_ptr": "*i64",
        "slot_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
        "qk_scale": "fp32"}, {"D": 128, "G_PAD": 16, "BLOCK_S": block, "FP32_DOTS": False,
                              "QUANTIZED": True, "FP8": fp8}, {"num_warps": 4, "num_stages": 2})
        for block in (32, 64)]
    launches.append((rotary_cache.rotary_cache_kernel, lambda dtype: {
        **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "q_out_ptr"),
                        f"*{dtype}"),
        "slots_ptr": "*i64", "kc_ptr": "*u8", "vc_ptr": "*u8", **scales},
        {"BLOCK": 64, "FP8": True}, {"num_warps": 1}))
    rows = []
    for kernel, types, constexprs, options in launches:
        for dtype in ("bf16", "fp16"):
            signature = {name: types(dtype).get(name, "i32") for name in kernel.arg_names
                         if name not in constexprs} | dict.fromkeys(constexprs, "constexpr")
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", arch, 32), options=options)
            sass = _sass(compiled.asm["cubin"])
            rows.append({"op": kernel.__name__, "dtype": dtype, "arch": arch,
                         "shared": compiled.metadata.shared,
                         "spills": len(re.findall(r"\b(?:STL|LDL)\b", sass))})
    return rows


if __name__ == "__main__":
    cache, archs = sys.argv[1:2] == ["cache"], sys.argv[1:]
    archs = map(int, archs[cache:] or ["90"])
    print(json.dumps([r for arch in archs
                      for r in (compile_cache_kernels if cache else compile_all)(arch)]))
