"""Reading NVFP4 checkpoints back: packed tensors equal to the quantizer's, shards and
indexes, and clear errors for missing, corrupt and truncated files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from qerl.errors import CheckpointError
from qerl.formats import nvfp4
from qerl.formats.nvfp4_checkpoint import load_checkpoint
from qerl.quantize import quantize_model
from qerl.sources import open_source

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def source_weights(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_loaded_packed_tensors_equal_a_fresh_quantization(tiny_model_dir, tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint)
    src = source_weights(tiny_model_dir)
    assert len(ckpt.quantized) == 14 and ckpt.ignore == ["lm_head"]
    for module, q in ckpt.quantized.items():
        w = src[f"{module}.weight"]
        assert q.shape == tuple(w.shape)
        parent, leaf = module.rsplit(".", 1)
        fused = next((g for g in FUSED if leaf in g), (leaf,))
        shared = nvfp4.shared_global_scale(*(src[f"{parent}.{m}.weight"] for m in fused))
        fresh = nvfp4.quantize(w, shared)
        assert torch.equal(q.packed, fresh.packed) and torch.equal(q.global_scale, shared)
    # Nothing dense but what must stay dense; all of it bf16.
    assert set(ckpt.dense) == {k for k in src if not k.endswith("proj.weight")}
    assert all(t.dtype == torch.bfloat16 for t in ckpt.dense.values())


def test_fused_projections_share_one_global_scale(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint)
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        qkv = {ckpt.quantized[f"{prefix}.self_attn.{p}_proj"].global_scale.item() for p in "qkv"}
        gate_up = {ckpt.quantized[f"{prefix}.mlp.{p}_proj"].global_scale.item()
                   for p in ("gate", "up")}
        assert len(qkv) == 1 and len(gate_up) == 1


def test_sharded_checkpoint_round_trips(tiny_model_dir, tiny_checkpoint, tmp_path):
    out = tmp_path / "sharded"
    quantize_model(open_source(str(tiny_model_dir)), out, max_shard_bytes=20_000, progress=False)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").exists()
    assert not list(out.glob("*.tmp"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    sharded, single = load_checkpoint(out), load_checkpoint(tiny_checkpoint)
    assert set(sharded.quantized) == set(single.quantized)
    for name, q in single.quantized.items():
        assert torch.equal(sharded.quantized[name].packed, q.packed)
    assert all(torch.equal(sharded.dense[k], t) for k, t in single.dense.items())


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_and_files_are_named(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "nope")
    ckpt = copy(tiny_checkpoint, tmp_path / "c")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing file: .*config.json"):
        load_checkpoint(ckpt)


def test_corrupt_config_is_named(tiny_checkpoint, tmp_path):
    ckpt = copy(tiny_checkpoint, tmp_path / "c")
    (ckpt / "config.json").write_text('{"model_type": "qwen2", ')
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_checkpoint(ckpt)


def test_unquantized_or_foreign_config_is_refused(tiny_model_dir, tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_checkpoint(tiny_model_dir)
    ckpt = copy(tiny_checkpoint, tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="expected 'compressed-tensors'/'nvfp4-pack"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors_is_named(tiny_checkpoint, tmp_path, keep):
    ckpt = copy(tiny_checkpoint, tmp_path / "c")
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(ckpt)


def test_garbage_safetensors_is_named(tiny_checkpoint, tmp_path):
    ckpt = copy(tiny_checkpoint, tmp_path / "c")
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(ckpt)


def test_inconsistent_packed_shapes_are_named(tiny_checkpoint, tmp_path):
    from safetensors.torch import save_file

    ckpt = copy(tiny_checkpoint, tmp_path / "c")
    tensors = source_weights(ckpt)
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj: weight_scale"):
        load_checkpoint(ckpt)
