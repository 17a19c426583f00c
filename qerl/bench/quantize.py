"""Benchmark `qerl quantize` on a paper-scale shape: wall time and peak host memory.

    python -m qerl.bench.quantize --arch qwen2.5-7b --out results/bench/quantize.csv

Two runs per architecture, each in a fresh process so that its peak RSS is its own:
- ``random``: weights generated tensor by tensor on the device (``--random-weights``);
- ``disk``: a BF16 safetensors checkpoint of the same shape, written first to --workdir,
  quantized from disk, as a user's model would be.
The baseline in the same run is ``load_only_s``: the time to produce every tensor on the
device without quantizing, i.e. the I/O floor. Quantizing streams one tensor (or fusion
group) at a time, so peak RSS should stay well under the BF16 model's size.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qerl.help_format import HelpFormatter
from qerl.record import append_rows, provenance


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(args: argparse.Namespace) -> dict:
    """Runs in a child process: time loading every tensor, then quantizing."""
    from qerl.quantize import quantize_model
    from qerl.sources import open_source

    source = open_source(args.model) if args.model else open_source(arch=args.arch)
    start = time.perf_counter()
    params = 0
    for name in source.names():
        t = source.load([name], args.device)[name]
        params += t.numel()
        t.clone()  # safetensors may hand out lazy file views: touch every byte once
        del t
    _sync(args.device)
    load_only = time.perf_counter() - start

    start = time.perf_counter()
    report = quantize_model(source, args.quant_out, overwrite=True, device=args.device,
                            progress=False)
    _sync(args.device)
    seconds = time.perf_counter() - start
    return {
        "params": params,
        "load_only_s": round(load_only, 2),
        "seconds": round(seconds, 2),
        "peak_rss_bytes": _peak_rss_bytes(),
        "checkpoint_bytes": report["summary"]["checkpoint_bytes"],
        "mean_rel_error": report["summary"]["mean_rel_error"],
    }


def write_bf16_checkpoint(arch: str, directory: Path, device: str) -> None:
    """A BF16 safetensors checkpoint of ``arch`` with random weights, 2 GiB shards."""
    from qerl.formats.nvfp4_checkpoint import ShardWriter
    from qerl.sources import open_source

    source = open_source(arch=arch)
    directory.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(directory)
    for name in source.names():
        writer.add(name, source.load([name], device)[name])
    writer.close()
    source.config.save_pretrained(directory)


def run_child(model: str | None, arch: str, device: str, quant_out: Path) -> dict:
    cmd = [sys.executable, "-m", "qerl.bench.quantize", "--child", "--arch", arch,
           "--device", device, "--quant-out", str(quant_out)]
    if model:
        cmd += ["--model", model]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"benchmark child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--arch", default="qwen2.5-7b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", default="random,disk", help="comma-separated: random,disk")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="scratch space for the BF16 and NVFP4 checkpoints")
    parser.add_argument("--out", type=Path, default=Path("results/bench/quantize.csv"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--quant-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return

    work = Path(tempfile.mkdtemp(dir=args.workdir, prefix="qerl-bench-"))
    rows = []
    try:
        for mode in args.modes.split(","):
            model = None
            if mode == "disk":
                model = str(work / "bf16")
                start = time.perf_counter()
                write_bf16_checkpoint(args.arch, work / "bf16", args.device)
                print(f"wrote BF16 checkpoint in {time.perf_counter() - start:.1f} s")
            result = run_child(model, args.arch, args.device, work / "nvfp4")
            bf16_bytes = 2 * result["params"]
            rows.append({
                **provenance(args.device),
                "arch": args.arch,
                "source": mode,
                "params": result["params"],
                "bf16_gb": round(bf16_bytes / 1e9, 3),
                "seconds": result["seconds"],
                "load_only_s": result["load_only_s"],
                "peak_rss_gb": round(result["peak_rss_bytes"] / 1e9, 3),
                "peak_rss_over_bf16": round(result["peak_rss_bytes"] / bf16_bytes, 3),
                "checkpoint_gb": round(result["checkpoint_bytes"] / 1e9, 3),
                "mean_rel_error": round(result["mean_rel_error"], 5),
            })
            print(rows[-1])
            shutil.rmtree(work / "nvfp4", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    append_rows(args.out, rows)


if __name__ == "__main__":
    main()
