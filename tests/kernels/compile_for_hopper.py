"""Compile every launch configuration of the NVFP4 kernels for sm_90 (no GPU needed) and
print, as JSON, each one's shared memory and register use. Run without TRITON_INTERPRET:
the interpreter accepts programs the compiler rejects."""

from __future__ import annotations

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qerl.kernels import nvfp4_matmul as km

POINTERS = {"fwd": ("x_ptr", "packed_ptr", "scale_ptr", "global_scale_ptr", "bias_ptr",
                    "out_ptr"),
            "bwd": ("dy_ptr", "packed_ptr", "scale_ptr", "global_scale_ptr", "out_ptr")}
TYPES = {"packed_ptr": "*u8", "scale_ptr": "*fp8e4nv", "global_scale_ptr": "*fp32",
         "out_ptr": "*fp32"}
SCALARS = {"fwd": ("M", "N", "K", "stride_xm", "stride_os", "stride_om", "stride_on"),
           "bwd": ("M", "N", "K", "stride_dym", "stride_os", "stride_om", "stride_ok")}


def compile_config(op: str, cfg: km.LaunchConfig) -> dict:
    kernel = km.nvfp4_fwd_kernel if op == "fwd" else km.nvfp4_bwd_kernel
    meta = cfg.meta(op)
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    constexprs = {**meta, "DOT_F32": False, **({"HAS_BIAS": True} if op == "fwd" else {})}
    signature = {p: TYPES.get(p, "*bf16") for p in POINTERS[op]}
    signature |= dict.fromkeys(SCALARS[op], "i32") | dict.fromkeys(constexprs, "constexpr")
    src = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    return {"op": op, **cfg.__dict__, "shared": compiled.metadata.shared,
            "local_memory": ".local" in ptx}


def all_configs() -> set[tuple[str, km.LaunchConfig]]:
    configs = set()
    for op in ("fwd", "bwd"):
        for m in (1, 16, 17, 32, 33, 64):
            # One split-K and one unsplit config per tile shape.
            for cols, red in ((37888, 3584), (3584, 18944)):
                configs.add((op, km.launch_config(op, m, cols, red, num_sms=132)))
    return configs


if __name__ == "__main__":
    print(json.dumps([compile_config(op, cfg) for op, cfg in sorted(all_configs(), key=str)]))
