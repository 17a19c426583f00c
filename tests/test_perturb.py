"""The matched-start control's model: Gaussian noise with the norm of NVFP4's error on
exactly the Linears NVFP4 quantizes, from a seed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qerl.cli import main
from qerl.formats import nvfp4
from qerl.perturb import nvfp4_matched_noise
from qerl.quantize import fusion_groups, quantize_group
from tests.conftest import fresh_seed


def test_each_quantized_linear_moves_as_far_as_nvfp4_moves_it(tiny_model_dir, tmp_path):
    seed = fresh_seed()
    out = tmp_path / "noised"
    main(["export", "--model", str(tiny_model_dir), "--method", "full", "--device", "cpu",
          "--perturb", "nvfp4-gaussian", "--seed", str(seed), "--out", str(out)])
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    after = load_file(out / "model.safetensors")
    linears = {n: m.weight for n, m in before.named_modules()
               if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    errors = {}
    for group in fusion_groups(list(linears)):
        quantized, _ = quantize_group({n: linears[n].float() for n in group})
        errors |= {n: (nvfp4.dequantize(q, torch.float32) - linears[n].float()).norm()
                   for n, q in quantized.items()}
    assert errors
    for name, w in before.state_dict().items():
        layer = name.removesuffix(".weight")
        if layer in errors:
            moved = (after[name].float() - w.float()).norm()
            # The noise's norm concentrates at the error's (a few thousand draws a layer).
            assert abs(moved / errors[layer] - 1) < 0.1, (name, seed)
            error = nvfp4.dequantize(quantize_group({layer: w.float()})[0][layer],
                                     torch.float32) - w.float()
            cosine = torch.nn.functional.cosine_similarity(
                (after[name].float() - w.float()).flatten(), error.flatten(), dim=0)
            assert abs(cosine) < 0.2, (name, seed)  # another direction than NVFP4's error
        elif name in after:
            assert torch.equal(after[name], w), name


def test_the_noise_is_the_seeds(tiny_model_dir):
    def noised(seed):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        relative = nvfp4_matched_noise(model, seed)
        return model.state_dict(), relative

    (a, rel_a), (b, _), (c, _) = noised(1), noised(1), noised(2)
    assert rel_a and all(0 < r < 0.5 for r in rel_a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_model_on_the_gpu_gets_the_noise_it_would_get_on_the_cpu(tiny_model_dir):
    """The draws are made on the CPU and moved; the error's norm comes from the model's own
    device (a CUDA model once failed here: a CPU draw times a CUDA norm)."""
    seed = fresh_seed()
    models = {device: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
              .to(device) for device in ("cpu", "cuda")}
    relative = {device: nvfp4_matched_noise(model, seed) for device, model in models.items()}
    assert relative["cpu"].keys() == relative["cuda"].keys()
    # First the sigmas (each layer's NVFP4 error, quantized on its model's device), then
    # the weights: a failure says which of the two differs.
    for name, error in relative["cpu"].items():
        assert relative["cuda"][name] == pytest.approx(error, rel=1e-6), (name, seed)
    for name, w in models["cpu"].state_dict().items():
        moved = models["cuda"].state_dict()[name].cpu()
        torch.testing.assert_close(moved, w, rtol=1e-5, atol=1e-6, msg=(name, seed))
