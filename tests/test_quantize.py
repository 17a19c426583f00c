"""`qerl quantize` end to end on tiny models: transformers loads the result, the report
holds per-layer errors, and bad input fails clearly without leaving a directory behind."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl.cli import main
from qerl.formats import nvfp4
from qerl.formats.nvfp4_checkpoint import load_checkpoint
from qerl.quantize import fusion_groups
from tests.conftest import run_python, save_tiny_model, tree_digests


def quantize(*args: str) -> int:
    return main(["quantize", "--quiet", *args])


def test_transformers_loads_the_checkpoint_with_our_weights(tiny_model_dir, tiny_checkpoint):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    ckpt = load_checkpoint(tiny_checkpoint)
    params = dict(model.named_parameters())
    for module, q in ckpt.quantized.items():
        assert torch.equal(params[f"{module}.weight"].to(torch.bfloat16), nvfp4.dequantize(q))

    # The quantized model still computes nearly the original function.
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokens = torch.tensor([[1, 5, 9, 77, 3, 120]])
    with torch.no_grad():
        ref = original(tokens).logits
        got = model.float()(tokens).logits
    assert (got - ref).norm() / ref.norm() < 0.3


def test_report_has_every_layer_and_a_summary(tiny_checkpoint):
    report = json.loads((tiny_checkpoint / "quantization_report.json").read_text())
    assert len(report["layers"]) == 14 and report["skipped"] == {}
    q = report["layers"]["model.layers.0.self_attn.q_proj"]
    assert q["shape"] == [64, 64] and set(q["fused_with"]) == {
        "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"}
    # ~10% on Gaussian weights; the planted outliers carry much of the norm, so less here.
    assert all(0.005 < layer["rel_error"] < 0.15 for layer in report["layers"].values())
    s = report["summary"]
    assert s["quantized_layers"] == 14 and s["max_rel_error"] >= s["mean_rel_error"]
    assert s["checkpoint_bytes"] < s["bf16_bytes"]


def test_tokenizer_and_generation_config_travel(tiny_model_dir, tiny_checkpoint):
    from transformers import PreTrainedTokenizerFast

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_checkpoint / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_checkpoint)
    assert tokenizer("w1 w2 w3").input_ids == [1, 2, 3]


def test_existing_output_is_refused_unless_overwrite(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert quantize("--model", str(tiny_model_dir), "--out", str(out)) == 0
    (out / "model.safetensors").write_bytes(b"stale")
    assert quantize("--model", str(tiny_model_dir), "--out", str(out)) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == b"stale"
    assert quantize("--model", str(tiny_model_dir), "--out", str(out), "--overwrite") == 0
    assert load_checkpoint(out).quantized


def test_overwrite_never_deletes_what_qerl_did_not_write(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    for out in (tmp_path, tiny_model_dir):  # a user's folder; the source model itself
        assert quantize("--model", str(tiny_model_dir), "--out", str(out), "--overwrite") == 2
        assert "is not an output of qerl" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert (tiny_model_dir / "model.safetensors").exists()


def test_k_not_multiple_of_16_stays_bf16_and_is_reported(tmp_path, capsys):
    src = tmp_path / "src"
    save_tiny_model(src, hidden=72, intermediate=96)  # K = 72 for q/k/v/gate/up
    assert quantize("--model", str(src), "--out", str(tmp_path / "out")) == 0
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())
    # q/k/v/o/gate/up read the 72-wide hidden state; only down_proj (K = 96) is quantized.
    assert len(report["skipped"]) == 12 and len(report["layers"]) == 2
    assert "K = 72 is not a multiple of 16" in report["skipped"]["model.layers.0.mlp.up_proj"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "model.layers.0.self_attn.q_proj" in config["quantization_config"]["ignore"]
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16

    assert quantize("--model", str(src), "--out", str(tmp_path / "strict"), "--strict") == 2
    assert "K = 72 is not a multiple of 16" in capsys.readouterr().err
    assert not (tmp_path / "strict").exists()


def test_nan_weight_fails_naming_the_layer_and_leaves_nothing(tmp_path, capsys):
    src = tmp_path / "src"
    save_tiny_model(src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, src / "model.safetensors", {"format": "pt"})
    assert quantize("--model", str(src), "--out", str(tmp_path / "out")) == 2
    assert "model.layers.1.mlp.down_proj: 1 NaN/Inf" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no partial directory


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/dir"], "neither a model directory"),
        (["--model", "missing.gguf"], "no such GGUF file"),
        (["--random-weights", "--arch", "qwen9-1b"], "unknown architecture 'qwen9-1b'"),
        (["--arch", "qwen2.5-7b"], "--random-weights and --arch go together"),
        ([], "give exactly one of --model"),
    ],
)
def test_bad_arguments_are_named(tmp_path, capsys, args, message):
    assert quantize(*args, "--out", str(tmp_path / "out")) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cuda_without_a_gpu_is_named(tiny_model_dir, tmp_path, capsys):
    assert quantize("--model", str(tiny_model_dir), "--out", str(tmp_path / "o"),
                    "--device", "cuda") == 2
    assert "no CUDA GPU is available" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_unknown_model_type_and_missing_tensor_are_named(tiny_model_dir, tmp_path, capsys):
    import shutil

    src = shutil.copytree(tiny_model_dir, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"model_type": "qwen99"}))
    assert quantize("--model", str(src), "--out", str(tmp_path / "a")) == 2
    assert "unknown architecture (model_type 'qwen99')" in capsys.readouterr().err

    (src / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, src / "model.safetensors", {"format": "pt"})
    assert quantize("--model", str(src), "--out", str(tmp_path / "b")) == 2
    assert "lacks tensor(s) ['model.layers.1.self_attn.o_proj.weight']" in capsys.readouterr().err


def test_an_already_quantized_model_is_refused(tiny_checkpoint, tmp_path, capsys):
    assert quantize("--model", str(tiny_checkpoint), "--out", str(tmp_path / "again")) == 2
    assert "is already quantized (compressed-tensors)" in capsys.readouterr().err


def test_fusion_groups_follow_vllm():
    layers = [f"m.l.0.self_attn.{p}_proj" for p in "qkvo"] + [
        f"m.l.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    assert fusion_groups(layers) == [layers[:3], [layers[3]], layers[4:6], [layers[6]]]


def test_of_two_concurrent_writers_to_one_out_exactly_one_succeeds(tiny_model_dir, tmp_path):
    """Both started at once: the claim lets one write; the other fails at once (claimed)
    or finds the finished output (exists). Never both, never a replaced directory."""
    import subprocess
    import sys

    out = tmp_path / "q"
    cmd = [sys.executable, "-m", "qerl.cli", "quantize", "--quiet", "--model",
           str(tiny_model_dir), "--out", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    done = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(rc == 0 for rc, _ in done) == [False, True], done
    failed = next(err for rc, err in done if rc != 0)
    assert "being written by another process" in failed or "already exists" in failed, failed
    assert load_checkpoint(out).quantized


def test_the_same_quantization_writes_the_same_bytes_in_any_process(tiny_model_dir, tmp_path):
    """Every file, the report included (no clock in it), equal across processes with other
    hash orders."""
    for seed in ("1", "2"):
        run_python(["-m", "qerl.cli", "quantize", "--quiet", "--model", str(tiny_model_dir),
                    "--out", str(tmp_path / seed)], seed)
    first = tree_digests(tmp_path / "1")
    assert "quantization_report.json" in first and first == tree_digests(tmp_path / "2")
