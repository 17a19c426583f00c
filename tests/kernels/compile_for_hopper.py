"""Compile every launch configuration of the NVFP4 kernels for sm_90 (no GPU needed) and
print, as JSON, each one's shared memory, local-memory traffic (register spills) and the
width of its packed-weight loads. Run without TRITON_INTERPRET: the interpreter accepts
programs the compiler rejects.

Arguments are specialised as at a real launch on Qwen2.5 shapes: pointers 16-byte aligned
and integer sizes and strides divisible by 16 (Triton's own specialisation)."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qerl.kernels import nvfp4_matmul as km

FWD_POINTERS = ("x_ptr", "packed_ptr", "scale_ptr", "global_scale_ptr", "bias_ptr", "out_ptr")
POINTERS = {"fwd": FWD_POINTERS, "gemv": FWD_POINTERS,
            "bwd": ("dy_ptr", "packed_ptr", "scale_ptr", "global_scale_ptr", "out_ptr")}
TYPES = {"packed_ptr": "*u8", "scale_ptr": "*fp8e4nv", "global_scale_ptr": "*fp32",
         "out_ptr": "*fp32"}
FWD_SCALARS = ("M", "N", "K", "stride_xm", "stride_pn", "stride_sn", "stride_os", "stride_om",
               "stride_on")
SCALARS = {"fwd": FWD_SCALARS, "gemv": FWD_SCALARS,
           "bwd": ("M", "N", "K", "stride_dym", "stride_pn", "stride_sn", "stride_os",
                   "stride_om", "stride_ok")}
UNIT_STRIDES = ("stride_on", "stride_ok")  # 1 at every launch: not divisible by 16


def _sass(cubin: bytes) -> str:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump), "--dump-sass", f.name], capture_output=True,
                              text=True, check=True).stdout


def compile_config(op: str, cfg: km.LaunchConfig) -> dict:
    kernel = {"gemv": km.nvfp4_gemv_kernel, "fwd": km.nvfp4_fwd_kernel,
              "bwd": km.nvfp4_bwd_kernel}[op]
    meta = cfg.meta(op)
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    constexprs = {**meta, "EVEN_K": True, **({"DOT_F32": False} if op != "gemv" else {}),
                  **({"HAS_BIAS": True} if op != "bwd" else {})}
    signature = {p: TYPES.get(p, "*bf16") for p in POINTERS[op]}
    signature |= dict.fromkeys(SCALARS[op], "i32") | dict.fromkeys(constexprs, "constexpr")
    divisible = [*POINTERS[op], *(s for s in SCALARS[op] if s not in ("M", *UNIT_STRIDES))]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    sass = _sass(compiled.asm["cubin"])
    loads = re.findall(r"LDG\.E(\.[A-Z0-9]+)*", sass)
    return {"op": op, **cfg.__dict__, "shared": compiled.metadata.shared,
            "spills": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
            "byte_loads": sum(1 for width in loads if width == ".U8")}


def all_configs() -> set[tuple[str, km.LaunchConfig]]:
    configs = set()
    for op, ms in (("gemv", (1, 2, 3, 4)), ("fwd", (5, 16)), ("bwd", (1, 16))):
        for m in ms:
            # One split-K and one unsplit config per tile shape.
            for cols, red in ((37888, 3584), (3584, 18944)):
                configs.add((op, km.launch_config(op, m, cols, red, num_sms=132)))
    return configs


if __name__ == "__main__":
    print(json.dumps([compile_config(op, cfg) for op, cfg in sorted(all_configs(), key=str)]))
