"""A benchmark's sweep over the Qwen2.5 models' fused linear layers (qkv, o, gate_up, down)
and M: its options, the (model, layer, shape) grid, and the rows appended as each layer is
measured."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from qerl import archs
from qerl.help_format import HelpFormatter
from qerl.record import append_rows


def layer_shapes(arch: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the fused layers vLLM runs: qkv, o, gate_up, down."""
    c = archs.config_for(arch)
    head_dim = c.hidden_size // c.num_attention_heads
    qkv = c.hidden_size + 2 * c.num_key_value_heads * head_dim
    return {"qkv": (qkv, c.hidden_size), "o": (c.hidden_size, c.hidden_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size)}


def sweep_arguments(prog: str, doc: str, models, layers, m_values,
                    argv: list[str] | None, more=None) -> argparse.Namespace:
    """The options of ``qerl bench PROG``, a sweep over models' layers and M (--out-dir,
    --models, --layers: None for every layer, --m as a list of ints), and those ``more``
    adds to the parser, parsed; refuses a machine without a GPU."""
    parser = argparse.ArgumentParser(prog=f"qerl bench {prog}", description=doc,
                                     formatter_class=HelpFormatter)
    if more is not None:
        more(parser)
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench"))
    parser.add_argument("--models", default=",".join(models))
    parser.add_argument("--layers", default=",".join(layers) if layers else None,
                        help="comma-separated, of qkv, o, gate_up, down"
                             + ("" if layers else " (default: every one)"))
    parser.add_argument("--m", default=",".join(map(str, m_values)), help="M values")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"qerl bench {prog}: needs a CUDA GPU (none found)")
    args.m = [int(m) for m in args.m.split(",")]
    return args


def model_layers(prog: str, models: str, layers: str) -> list[tuple[str, str, tuple[int, int]]]:
    """(model, layer, (N, K)) for each of the comma-separated models and layers; a layer a
    model lacks is refused before anything is measured."""
    grid = []
    for arch in models.split(","):
        shapes = layer_shapes(arch)
        unknown = sorted(set(layers.split(",")) - set(shapes))
        if unknown:
            raise SystemExit(f"qerl bench {prog}: no layer {unknown}; the layers are "
                             f"{', '.join(shapes)}")
        grid += [(arch, layer, shapes[layer]) for layer in layers.split(",")]
    return grid


def record_sweep(path: Path, base: dict, grid, measure, **extra) -> None:
    """Each (model, layer, (N, K)) of ``grid`` measured in turn (``measure(N, K)`` -> rows),
    its rows appended to ``path`` as they come, with ``base`` (provenance), ``extra``
    columns and the layer's name; the GPU's cache emptied between layers."""
    for arch, layer, shape in grid:
        rows = measure(*shape)
        append_rows(path, [{**base, **extra, "layer": f"{arch}.{layer}", **row} for row in rows])
        torch.cuda.empty_cache()


def say_times(label: str, bf16_us: float, timed: dict) -> None:
    """One measured point of a sweep as a line: BF16's time, then each variant's (us)."""
    print(f"{label}: bf16 {bf16_us:.1f} us, "
          + ", ".join(f"{name} {us:.1f}" for name, us in timed.items()), flush=True)
