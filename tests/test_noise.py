"""AQN: the stage schedule, fresh non-accumulating noise, bit-identical stage 0, and noise of
the expected size reaching the model's outputs."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from qerl.noise import AdaptiveQuantizationNoise, AQNError, AQNSettings, noisy_norm_weights
from tests.conftest import fresh_seed, tiny_config


def tiny_model(seed: int, arch: str = "qwen2"):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).to(torch.bfloat16).eval()
    with torch.no_grad():  # norms away from exactly 1, as after training
        for w in noisy_norm_weights(model).values():
            w.uniform_(0.5, 1.5)
    return model


def test_schedule_is_exponential_from_start_to_end_after_a_clean_stage():
    s = AQNSettings(sigma_start=1e-2, sigma_end=1e-4, num_stages=10)
    sigmas = [s.sigma(i) for i in range(10)]
    assert sigmas[0] == 0.0
    assert sigmas[1] == pytest.approx(1e-2) and sigmas[9] == pytest.approx(1e-4)
    ratios = [sigmas[i + 1] / sigmas[i] for i in range(1, 9)]
    assert all(r == pytest.approx(ratios[0]) for r in ratios)
    assert ratios[0] == pytest.approx(0.01 ** (1 / 8))
    assert AQNSettings(num_stages=2).sigma(1) == AQNSettings().sigma_start
    # Equal stages over the run: 100 steps, 10 stages of 10.
    assert [s.stage(step, 100) for step in (0, 9, 10, 55, 99)] == [0, 0, 1, 5, 9]
    assert [s.stage(step, 7) for step in range(7)] == [0, 1, 2, 4, 5, 7, 8]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_stages": 1}, "num_stages\n  Input should be greater than or equal to 2"),
    ({"sigma_start": 1e-4, "sigma_end": 1e-2}, "sigma_end <= sigma_start"),
    ({"sigma_end": 0.0}, "sigma_end\n  Input should be greater than 0"),
    ({"sigma": 1e-2}, "sigma\n  Extra inputs are not permitted"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        AQNSettings(**kwargs)


def test_stage_zero_leaves_outputs_bit_identical():
    model = tiny_model(fresh_seed())
    ids = torch.randint(0, 128, (2, 9))
    clean = model(ids).logits
    aqn = AdaptiveQuantizationNoise(model, AQNSettings(num_stages=4), total_steps=8)
    assert aqn.perturb(step=1) == 0.0  # steps 0-1 are stage 0
    assert torch.equal(model(ids).logits, clean)
    aqn.restore()


def test_noise_is_fresh_every_step_never_accumulates_and_replays_by_seed():
    seed = fresh_seed()
    model = tiny_model(seed)
    settings = AQNSettings(sigma_start=1e-2, sigma_end=1e-3, num_stages=3)
    aqn = AdaptiveQuantizationNoise(model, settings, total_steps=30, seed=seed)
    weights = noisy_norm_weights(model)
    assert len(weights) == 4  # 2 layers x (input, post-attention); the final norm is left
    clean = {n: w.clone() for n, w in weights.items()}
    seen = []
    for step in range(10, 30):
        sigma = aqn.perturb(step)
        assert sigma == aqn.sigma > 0
        z = {n: weights[n].float() - clean[n].float() for n in weights}
        seen.append(torch.cat([v.flatten() for v in z.values()]))
        with pytest.raises(AQNError, match="already applied"):
            aqn.perturb(step)
        aqn.restore()
        assert all(torch.equal(weights[n], clean[n]) for n in weights), "noise accumulated"
    assert not any(torch.equal(seen[i], seen[i + 1]) for i in range(len(seen) - 1))
    # One value per channel, of the stage's size.
    assert seen[0].std().item() == pytest.approx(1e-2, rel=0.35)
    # A resumed run draws the same noise for the same step.
    again = AdaptiveQuantizationNoise(model, settings, total_steps=30, seed=seed).noise(29)
    replay = torch.cat([v.flatten() for v in again.values()])
    assert torch.allclose(replay, seen[-1], rtol=0, atol=1e-7)  # seen: (w + z) - w in fp32


def test_noise_changes_a_projection_by_its_expected_size():
    """y = W (g * x_hat): noise Z on the norm weight g moves y by W (Z * x_hat), whose mean
    square is sigma^2 * sum_j W_ij^2 x_hat_j^2: matched over many draws."""
    seed = fresh_seed()
    model = tiny_model(seed).float()
    layer = model.model.layers[0]
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed))
    x_hat = layer.input_layernorm(x) / layer.input_layernorm.weight
    w = layer.self_attn.q_proj.weight
    clean = layer.self_attn.q_proj(layer.input_layernorm(x))
    aqn = AdaptiveQuantizationNoise(model, AQNSettings(num_stages=2), total_steps=400)
    sigma = AQNSettings(num_stages=2).sigma(1)
    moved = []
    for step in range(200, 400):
        aqn.perturb(step)
        moved.append((layer.self_attn.q_proj(layer.input_layernorm(x)) - clean).square())
        aqn.restore()
    measured = torch.stack(moved).mean(0)
    expected = sigma**2 * (w.square() * x_hat.square()).sum(-1)
    ratio = (measured.sum() / expected.sum()).item()
    assert 0.8 < ratio < 1.25, f"seed {seed}: measured/expected {ratio}"


def test_noise_below_bf16_resolution_still_reaches_a_bf16_model():
    """sigma 1e-4 is far below bf16's step near 1 (2^-7): the norm weights are kept in fp32
    so that the noise is not rounded away."""
    model = tiny_model(fresh_seed())
    ids = torch.randint(0, 128, (2, 9))
    clean = model(ids).logits
    settings = AQNSettings(sigma_start=1e-4, sigma_end=1e-4, num_stages=2)
    aqn = AdaptiveQuantizationNoise(model, settings, total_steps=2)
    assert torch.equal(model(ids).logits, clean)  # fp32 norm weights: same outputs
    aqn.perturb(1)
    noisy = model(ids).logits
    assert noisy.dtype == torch.bfloat16 and not torch.equal(noisy, clean)


def test_logit_change_grows_linearly_with_sigma():
    seed = fresh_seed()
    model = tiny_model(seed).float()
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(seed))
    clean = model(ids).logits

    def change(sigma: float) -> float:
        settings = AQNSettings(sigma_start=sigma, sigma_end=sigma, num_stages=2)
        aqn = AdaptiveQuantizationNoise(model, settings, 2, seed=seed)
        aqn.perturb(1)
        delta = (model(ids).logits - clean).norm() / clean.norm()
        aqn.restore()
        return delta.item()

    small, large = change(1e-4), change(1e-3)
    assert small > 1e-6 and math.isclose(large / small, 10, rel_tol=0.1), (seed, small, large)


def test_trainable_norms_learn_on_clean_values():
    """Restore before the optimizer step: the update lands on the clean weight."""
    model = tiny_model(fresh_seed()).float()
    weights = noisy_norm_weights(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for w in weights.values():
        w.requires_grad_(True)
    opt = torch.optim.SGD(list(weights.values()), lr=0.1)
    aqn = AdaptiveQuantizationNoise(model, AQNSettings(num_stages=2), total_steps=5)
    ids = torch.randint(0, 128, (2, 6))
    for step in range(1, 5):
        before = {n: w.detach().clone() for n, w in weights.items()}
        aqn.perturb(step)
        model(ids).logits.square().mean().backward()
        aqn.restore()
        grads = {n: w.grad.clone() for n, w in weights.items()}
        opt.step()
        opt.zero_grad()
        for n, w in weights.items():
            assert torch.allclose(w, before[n] - 0.1 * grads[n], rtol=0, atol=1e-7)


def test_a_model_without_rmsnorms_is_refused():
    with pytest.raises(AQNError, match="nothing to perturb"):
        AdaptiveQuantizationNoise(torch.nn.Linear(4, 4), AQNSettings(), total_steps=3)
