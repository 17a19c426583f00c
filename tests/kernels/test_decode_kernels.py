"""The decode step's kernels (RMSNorm + residual, rotary + cache write, LoRA shrink/expand)
against the modules they replace, transformers' RMSNorm and rotary embedding and PEFT's
LoRA Linear: under Triton's CPU interpreter on small odd shapes (fp32, where the
interpreter rounds like the GPU) and in bf16 on a GPU. They round where those modules
round; only the order of their sums differs (rotary has none: bit-exact)."""

from __future__ import annotations

import importlib

import pytest
import torch

from qerl.kernels import lora_decode, rmsnorm, rotary_cache
from qerl.kernels.device_facts import interpreting
from tests.conftest import fresh_seed
from tests.kernels.conftest import device

needs_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="no GPU and no interpreter")
pytestmark = needs_kernels


def dtypes():
    """fp32 everywhere; bf16 only on a GPU (the interpreter truncates fp32 -> bf16)."""
    return [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device())


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("n", [40, 96])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_rms_norm_matches_hugging_face(poisoned, dtype, n, arch):
    """Against transformers' own RMSNorm module of the family, fed the residual sum as the
    decoder layer computes it (h + residual in the model's dtype); with AQN's fp32 weight,
    its output cast back to the input's dtype (AQN's hook)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    norm_class = getattr(importlib.import_module(
        f"transformers.models.{arch}.modeling_{arch}"), f"{arch.capitalize()}RMSNorm")
    x, res = rand(gen, 3, 5, n, dtype=dtype), rand(gen, 3, 5, n, dtype=dtype)
    for weight in (rand(gen, n, dtype=dtype), rand(gen, n)):  # model dtype, and AQN's fp32
        norm = norm_class(n, eps=1e-6).to(device())
        with torch.no_grad():
            norm.weight = torch.nn.Parameter(weight)
        for residual in (None, res):
            out, total = rmsnorm.rms_norm(x, weight, 1e-6, residual)
            h = x if residual is None else x + residual
            with torch.no_grad():
                ref_out = norm(h).to(dtype)
            assert torch.equal(total, h), seed
            assert out.dtype == dtype
            # Only the sum of squares' order differs; bf16 rows may round one ulp apart.
            tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {
                "atol": 1e-2, "rtol": 1e-2}
            torch.testing.assert_close(out, ref_out, **tol, msg=lambda m, s=seed: f"{s}: {m}")


def test_rms_norm_on_strided_rows_and_bad_weight():
    gen = torch.Generator().manual_seed(fresh_seed())
    h = rand(gen, 2, 7, 32)
    weight = rand(gen, 32)
    out, _ = rmsnorm.rms_norm(h[:, -1:], weight, 1e-5)
    torch.testing.assert_close(out, rmsnorm.reference_rms_norm(h[:, -1:], weight, 1e-5)[0],
                               atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="weight has shape"):
        rmsnorm.rms_norm(h, rand(gen, 31), 1e-5)


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_rotary_into_cache_matches_hugging_face(poisoned, dtype, arch):
    """Against transformers' own rotary embedding module and apply_rotary_pos_emb of the
    family (positions past each sequence's padding, as the engine gives them): queries
    returned, keys and values written at their slots; the rest of the cache untouched."""
    from transformers import AutoConfig

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, steps, heads, kv_heads, head_dim, slots = 3, 2, 6, 2, 24, 9
    modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    config = AutoConfig.for_model(arch, hidden_size=heads * head_dim, head_dim=head_dim,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads)
    rotary = getattr(modeling, f"{arch.capitalize()}RotaryEmbedding")(config).to(device())
    q = rand(gen, batch, steps, heads * head_dim, dtype=dtype)
    k, v = (rand(gen, batch, steps, kv_heads * head_dim, dtype=dtype) for _ in range(2))
    where = torch.tensor([4, 7], device=device())
    positions = where[None, :] - torch.tensor([[0], [3], [1]], device=device())  # pads
    cos, sin = rotary(q, positions)
    # A cache for 5 sequences, of which the batch is the first 3 (as the engine slices it).
    k_cache, v_cache = (rand(gen, 2, 5, kv_heads, slots, head_dim, dtype=dtype)
                        for _ in range(2))
    got_k, got_v = k_cache.clone(), v_cache.clone()
    got = rotary_cache.rotary_into_cache(q, k, v, cos, sin, got_k[1, :batch],
                                         got_v[1, :batch], where)
    shape = (batch, steps, -1, head_dim)
    ref, ref_k = modeling.apply_rotary_pos_emb(q.view(shape).transpose(1, 2),
                                               k.view(shape).transpose(1, 2), cos, sin)
    k_cache[1, :batch, :, where] = ref_k
    v_cache[1, :batch, :, where] = v.view(shape).transpose(1, 2)
    # 16-bit: bit-exact. fp32: Triton may contract q*cos + rot(q)*sin into an FMA.
    tol = ({"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32
           else {"atol": 0, "rtol": 0})
    for a, b in ((got, ref), (got_k, k_cache), (got_v, v_cache)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, s=seed: f"{s}: {m}")


@pytest.mark.parametrize("dtype", dtypes())
def test_rotary_into_an_fp8_cache_writes_each_heads_quotient_rounded_once(poisoned, dtype):
    """An fp8 cache: each rotated key and value divided by its (sequence, kv head)'s scale
    and rounded to E4M3 once, saturating: the bytes of torch's cast of the float64
    quotient of what the kernel writes into a cache of the model's dtype, and of what the
    reference (the family's apply_rotary_pos_emb) computes; the queries as there; the
    rest of the cache untouched. Scales from 2^-8 to 2^3 make heads saturate and values
    subnormal; head_dim 24 is no power of two."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, steps, heads, kv_heads, head_dim, slots = 3, 2, 6, 2, 24, 9
    q = rand(gen, batch, steps, heads * head_dim, dtype=dtype)
    k, v = (rand(gen, batch, steps, kv_heads * head_dim, dtype=dtype, scale=4.0)
            for _ in range(2))
    angles = torch.rand(batch, steps, head_dim // 2, generator=gen) * 100
    cos, sin = (f(angles).repeat(1, 1, 2).to(dtype).to(device()) for f in (torch.cos,
                                                                            torch.sin))
    where = torch.tensor([4, 7], device=device())
    plain = [rand(gen, batch, kv_heads, slots, head_dim, dtype=dtype) for _ in range(2)]
    q_plain = rotary_cache.rotary_into_cache(q, k, v, cos, sin, *plain, where)
    # An fp8 cache for 5 sequences, of which the batch is the first 3, with its scales.
    before = [rand(gen, 2, 5, kv_heads, slots, head_dim).to(torch.float8_e4m3fn)
              for _ in range(2)]
    scales = [torch.exp2(torch.randint(-8, 4, (2, 5, kv_heads), generator=gen).float())
              for _ in range(2)]
    for scale in scales:  # the extremes, whatever was drawn
        scale[1, 0, 0], scale[1, 1, 1] = 2.0 ** -8, 2.0 ** 3
    scales = [scale.to(device()) for scale in scales]

    def written(cache, x, scale):  # x [B, KVH, T, D] at slots `where`, by torch's cast
        out = cache.clone()
        quotient = x.double() / scale[1, :batch, :, None, None].double()
        out[1, :batch, :, where] = quotient.clamp(-448, 448).to(torch.float8_e4m3fn)
        return out.view(torch.uint8)

    shape = (batch, steps, -1, head_dim)
    ref_k = apply_rotary_pos_emb(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2),
                                 cos, sin)[1]
    kernel_v = plain[1][:, :, where]
    expected = {True: [written(before[0], plain[0][:, :, where], scales[0]),
                       written(before[1], kernel_v, scales[1])],
                False: [written(before[0], ref_k, scales[0]),
                        written(before[1], kernel_v, scales[1])]}
    bits = expected[True][0]
    assert ((bits & 0x7F) == 0x7E).any() and ((bits & 0x78) == 0).any()  # saturated, subnormal
    for fused in (True, False):
        got = [c.clone() for c in before]
        layer = [c[1, :batch] for c in got]
        layer_scales = {"k_scale": scales[0][1, :batch], "v_scale": scales[1][1, :batch]}
        if fused:
            got_q = rotary_cache.rotary_into_cache(q, k, v, cos, sin, *layer, where,
                                                   **layer_scales)
            assert torch.equal(got_q, q_plain), seed
        else:
            rotary_cache.reference_rotary_into_cache(q, k, v, cos, sin, *layer, where,
                                                     apply_rotary_pos_emb, **layer_scales)
        for a, b in zip(got, expected[fused], strict=True):
            assert torch.equal(a.view(torch.uint8), b), (seed, fused)


def test_rotary_into_cache_refuses_mismatched_heads():
    gen = torch.Generator().manual_seed(0)
    cache = rand(gen, 1, 2, 4, 8)
    with pytest.raises(ValueError, match="heads"):
        rotary_cache.rotary_into_cache(rand(gen, 1, 1, 20), rand(gen, 1, 1, 16),
                                       rand(gen, 1, 1, 16), rand(gen, 1, 1, 8),
                                       rand(gen, 1, 1, 8), cache, cache,
                                       torch.zeros(1, dtype=torch.long, device=device()))


@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "rank", "group", "splits"),
                         [(1, 8, 3, 3), (5, 16, 2, 1), (19, 24, 1, 2), (33, 64, 3, None),
                          (70, 16, 2, 3), (200, 32, 3, None), (449, 32, 2, None)])
def test_lora_shrink_expand_match_peft(poisoned, lora_dtype, rows, rank, group, splits):
    """Each member of a group against PEFT's own LoRA Linear (dropout off) over a frozen
    Linear: its base given to the expand whole, or as fp32 partial sums over slices of K
    (as the NVFP4 kernel hands them over)."""
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as LoraLinear

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if interpreting() else torch.bfloat16
    k, widths = 136, [72, 40, 40][:group]
    x = rand(gen, rows, k, dtype=dtype)
    layers = []
    for n in widths:
        base = torch.nn.Linear(k, n, bias=False, device=device(), dtype=dtype)
        with torch.no_grad():
            base.weight.copy_(rand(gen, n, k, dtype=dtype, scale=0.1))
        layer = LoraLinear(base, "default", LoraConfig(), r=rank, lora_alpha=rank // 2)
        layer.to(device())
        with torch.no_grad():
            for part, shape in (("lora_A", (rank, k)), ("lora_B", (n, rank))):
                module = getattr(layer, part)["default"].to(lora_dtype)
                module.weight.copy_(rand(gen, *shape, dtype=lora_dtype, scale=0.1))
        layers.append(layer.eval())
    a = [layer.lora_A["default"].weight for layer in layers]
    b = [layer.lora_B["default"].weight for layer in layers]
    xa = lora_decode.lora_shrink(x, a, splits)
    assert xa.shape == (rows, group * rank)
    for g, layer in enumerate(layers):
        with torch.no_grad():
            ref = layer(x)
            weight = layer.base_layer.weight.float()
            partials = torch.stack([x[:, s].float() @ weight[:, s].T for s in
                                    (slice(0, 48), slice(48, 96), slice(96, k))])
        for given in (partials, partials.sum(0).to(dtype)[None]):
            got = lora_decode.lora_expand(xa, g, b[g], layer.scaling["default"], given, dtype)
            assert got.dtype == dtype
            exact = dtype == torch.float32 and lora_dtype == torch.float32
            tol = {"atol": 1e-5, "rtol": 1e-5} if exact else {"atol": 2e-2, "rtol": 2e-2}
            torch.testing.assert_close(got, ref, **tol, msg=lambda m, s=seed: f"{s}: {m}")


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize(("rows", "splits", "base_splits"), [(3, 2, 1), (18, 1, 3), (131, 2, 2)])
def test_grouped_expand_equals_one_launch_per_member(poisoned, dtype, rows, splits,
                                                     base_splits):
    """Members side by side (widths off the 64-column block), and gate/up with SiLU and
    the product fused, against torch's silu(gate) * up of the members' own outputs."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    k, rank, widths = 72, 16, [72, 24, 40]
    x = rand(gen, rows, k, dtype=dtype)
    a = [rand(gen, rank, k, dtype=dtype, scale=0.1) for _ in widths]
    b = [rand(gen, n, rank, dtype=dtype, scale=0.1) for n in widths]
    bases = [rand(gen, base_splits, rows, n) for n in widths]
    if base_splits == 1:
        bases = [base.to(dtype) for base in bases]
    xa = lora_decode.lora_shrink(x, a, splits)
    one = [lora_decode.lora_expand(xa, g, b[g], 0.5 + g, bases[g], dtype) for g in range(3)]
    grouped = lora_decode.lora_expand_group(xa, b, [0.5, 1.5, 2.5], bases, dtype)
    for g in range(3):
        assert grouped[g].shape == (rows, widths[g])
        assert torch.equal(grouped[g], one[g]), (g, seed)
    # gate and up: members 1 and 2 of the shrink (of one width)
    up_b = rand(gen, widths[1], rank, dtype=dtype, scale=0.1)
    up_base = rand(gen, base_splits, rows, widths[1]).to(bases[1].dtype)
    act = lora_decode.lora_expand_group(xa, [b[1], up_b], [1.5, 2.5], [bases[1], up_base],
                                        dtype, first=1, silu_mul=True)[0]
    up = lora_decode.lora_expand(xa, 2, up_b, 2.5, up_base, dtype)
    ref = torch.nn.functional.silu(one[1]) * up
    # exp and the division may differ from torch's in the last fp32 bit: one rounding of
    # the 16-bit result apart at most.
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2,
                                                                         "rtol": 8e-3}
    torch.testing.assert_close(act, ref, **tol, msg=lambda m: f"{seed}: {m}")


@pytest.mark.parametrize("rank", [16, 64])
def test_expand_of_fp32_adapters_is_fp32_accurate(poisoned, rank):
    """PEFT keeps adapters in fp32 beside a 16-bit base: their expand runs on the tensor
    cores as 3xTF32 and must stay within fp32 rounding of a float64 product (one TF32
    pass would be ~1e-3 off)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rows, n = 5, 200
    xa = rand(gen, rows, 2 * rank)
    b = rand(gen, n, rank)
    base = rand(gen, 3, rows, n)
    got = lora_decode.lora_expand(xa, 1, b, 0.75, base, torch.float32)
    ref = base.double().sum(0) + xa[:, rank:].double() @ b.double().T * 0.75
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{seed}: {m}")


@pytest.mark.parametrize("dtype", dtypes())
def test_expand_adds_up_the_shrinks_partial_sums_in_order(poisoned, dtype):
    """xa given as split-K partial sums [S, M, G * R] (the NVFP4 launch's own shrink): the
    expand of their sum, added in order, bit for bit."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rows, rank, widths = 5, 8, [40, 24]
    parts = rand(gen, 3, rows, 2 * rank)
    b = [rand(gen, n, rank, scale=0.1) for n in widths]
    bases = [rand(gen, 2, rows, n) for n in widths]
    summed = parts[0] + parts[1] + parts[2]
    got = lora_decode.lora_expand_group(parts, b, [0.5, 2.0], bases, dtype)
    ref = lora_decode.lora_expand_group(summed, b, [0.5, 2.0], bases, dtype)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r), seed
    with pytest.raises(ValueError, match="partial sums of it"):
        lora_decode.lora_expand_group(parts[..., :rank], b, [0.5, 2.0], bases, dtype)


def test_grouped_expand_refuses_what_it_cannot_join():
    gen = torch.Generator().manual_seed(0)
    x = rand(gen, 4, 32)
    xa = lora_decode.lora_shrink(x, [rand(gen, 8, 32), rand(gen, 8, 32)])
    b = [rand(gen, 16, 8), rand(gen, 24, 8)]
    with pytest.raises(ValueError, match="one width"):
        lora_decode.lora_expand_group(xa, b, [1.0, 1.0], [rand(gen, 1, 4, 16),
                                                          rand(gen, 1, 4, 24)],
                                      torch.float32, silu_mul=True)
    with pytest.raises(ValueError, match="same number of partial sums"):
        lora_decode.lora_expand_group(xa, b, [1.0, 1.0], [rand(gen, 1, 4, 16),
                                                          rand(gen, 2, 4, 24)], torch.float32)


def test_lora_shrink_adds_up_its_slices_the_same_way_at_every_launch():
    """The last program of each member and row tile sums the slices' partials (a counter
    each, left at zero for the next launch): one result, equal to an unsplit shrink to fp32
    rounding, bit for bit the same when repeated."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, a = rand(gen, 75, 200), [rand(gen, 16, 200), rand(gen, 16, 200), rand(gen, 16, 200)]
    split = lora_decode.lora_shrink(x, a, splits=4)  # 3 tiles of rows
    assert split.shape == (75, 48)
    assert torch.equal(split, lora_decode.lora_shrink(x, a, splits=4)), seed
    assert not lora_decode._counters(x.device).any()
    ref = x.double() @ torch.cat(a).double().T
    # fp32's error bound for a sum of n products, n u sum |x_i a_i|: a fixed tolerance
    # failed a fresh seed on one element of a sum that cancelled.
    bound = 200 * 2.0**-24 * (x.double().abs() @ torch.cat(a).double().abs().T)
    assert ((split.double() - ref).abs() <= bound).all(), seed
    unsplit = lora_decode.lora_shrink(x, a, splits=1).double()
    assert ((split.double() - unsplit).abs() <= 2 * bound).all(), seed


def test_lora_kernels_refuse_what_they_cannot_hold():
    gen = torch.Generator().manual_seed(0)
    x = rand(gen, lora_decode.MAX_ROWS + 1, 32)
    with pytest.raises(ValueError, match="rows"):
        lora_decode.lora_shrink(x, [rand(gen, 8, 32)])
    with pytest.raises(ValueError, match="contiguous"):
        lora_decode.lora_shrink(x[:4], [rand(gen, 8, 32), rand(gen, 4, 32)])
    xa = lora_decode.lora_shrink(x[:4], [rand(gen, 8, 32)])
    with pytest.raises(ValueError, match="base must be"):
        lora_decode.lora_expand(xa, 0, rand(gen, 16, 8), 1.0, rand(gen, 4, 16), torch.float32)
