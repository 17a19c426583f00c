"""The split-KV decode attention against SDPA with a boolean mask in float64: under Triton's
CPU interpreter on small odd shapes in fp32 and bf16, over a bf16/fp32 cache and an fp8 one
with its scales (read by the fp8 conversion and from the bits, as before sm_89), and on a
GPU (where it also replays from a CUDA graph at a later slot)."""

from __future__ import annotations

import pytest
import torch

from qerl.kernels import compute_capability as cc
from qerl.kernels import decode_attention as da
from qerl.kernels.device_facts import interpreting
from tests.conftest import fresh_seed
from tests.kernels.conftest import device

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                reason="no GPU and no interpreter")
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def dtypes():
    """fp32 and bf16 (under the interpreter, whose 16-bit tl.dot is wrong, the kernel's
    fp32 dots with p rounded to bf16: the path a CPU engine test takes)."""
    return [torch.float32, torch.bfloat16]


def tolerance(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2,
                                                                         "rtol": 1e-2}


def cache_views(gen, batch, kv_heads, span, head_dim, dtype, layout):
    """k and v [B, KVH, S, D] as the engine hands them over: views into a bigger buffer
    (more layers, sequences and slots, all NaN outside the view). ``layout`` "heads first"
    is the engine's [L, B, KVH, S, D]; "slots first" a [L, B, S, KVH, D] buffer seen
    through a transpose, so that the slot stride is not D."""
    views = []
    for _ in range(2):
        if layout == "heads first":
            buf = torch.full((2, batch + 2, kv_heads, span + 13, head_dim), float("nan"))
            view = buf[1, 1:batch + 1, :, :span]
        else:
            buf = torch.full((2, batch + 1, span + 5, kv_heads, head_dim), float("nan"))
            view = buf[0, :batch, 3:span + 3].transpose(1, 2)
        view.copy_(torch.randn(view.shape, generator=gen))
        buf = buf.to(dtype).to(device())
        views.append(buf[1, 1:batch + 1, :, :span] if layout == "heads first"
                     else buf[0, :batch, 3:span + 3].transpose(1, 2))
    return views


def queries(gen, batch, heads, head_dim, dtype):
    """[B, H, 1, D] as the projection leaves it: a transpose of [B, 1, H, D]."""
    q = torch.randn(batch, 1, heads, head_dim, generator=gen)
    return q.to(dtype).to(device()).transpose(1, 2)


def pads_for(gen, batch, slot):
    """Pad 0, a pad leaving only 3 live slots, then random ones."""
    pads = [0, max(0, slot - 2), *torch.randint(0, slot + 1, (batch,), generator=gen).tolist()]
    return torch.tensor(pads[:batch], dtype=torch.long, device=device())


def float64_reference(q, k, v, pad, slot, scale, k_scale=None, v_scale=None):
    # the view's NaN neighbours do not matter: SDPA takes the view's values
    if k_scale is not None:  # dequantized to float64 by the reference
        return da.reference_decode_attention(q.double(), k, v, pad, slot, scale, k_scale,
                                             v_scale)
    return da.reference_decode_attention(q.double(), k.double(), v.double(), pad, slot, scale)


def scale_views(gen, batch, kv_heads):
    """k and v scales [B, KVH] as the engine hands them over (views of [L, B, KVH], NaN
    around them): powers of two from 2^-4 to 2^3, a head's own each."""
    views = []
    for _ in range(2):
        buf = torch.full((2, batch + 2, kv_heads), float("nan"))
        buf[1, 1:batch + 1] = torch.exp2(torch.randint(-4, 4, (batch, kv_heads),
                                                       generator=gen).float())
        views.append(buf.to(device())[1, 1:batch + 1])
    return views


# (B, H, KVH, S, D): G = 1, 2, 7 (Qwen 7B: 28 q / 4 kv heads), S off the 32/64-slot tiles
SHAPES = [(3, 4, 4, 37, 16), (2, 4, 2, 100, 32), (2, 14, 2, 75, 16), (1, 28, 4, 70, 64)]


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-KVH{}-S{}-D{}".format(*s))
def test_matches_float64_sdpa(poisoned, dtype, shape):
    """Against SDPA in float64 with the boolean mask: per-sequence pads, the query in the
    middle of the span and at its end; the launch policy's NSPLIT, one split (several tiles
    a program) and 5 (splits that hold no live slot); the same bits on every run."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, span, head_dim = shape
    layout = "heads first" if span % 2 else "slots first"
    k, v = cache_views(gen, batch, kv_heads, span, head_dim, dtype, layout)
    q = queries(gen, batch, heads, head_dim, dtype)
    scale = head_dim ** -0.5
    for where in (span // 2, span - 1):
        slot = torch.tensor(where, device=device())
        pad = pads_for(gen, batch, where)
        ref = float64_reference(q, k, v, pad, slot, scale)
        for splits in (None, 1, 5):
            got = da.decode_attention(q, k, v, pad, slot, scale, splits=splits)
            assert got.shape == q.shape and got.dtype == dtype
            torch.testing.assert_close(got.double(), ref, **tolerance(dtype),
                                       msg=lambda m, s=seed, w=where, n=splits:
                                       f"seed {s}, slot {w}, splits {n}: {m}")
            again = da.decode_attention(q, k, v, pad, slot, scale, splits=splits)
            assert torch.equal(got, again), (seed, where, splits)


@pytest.mark.parametrize("read", ["fp8 conversion", "bits"])
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "B{}-H{}-KVH{}-S{}-D{}".format(*s))
def test_an_fp8_cache_matches_float64_sdpa_over_it_dequantized(poisoned, monkeypatch, read,
                                                              dtype, shape):
    """An fp8 cache (E4M3 values, NaN bytes around the views) and a scale per (sequence, kv
    head): attention over the float64 dequantized cache, as the prefill reads it, to the
    tolerance of q's dtype; read by the fp8 conversion or, as a card before sm_89 (no fp8
    type), from the bits; the same bits on every run."""
    if read == "bits":
        monkeypatch.setenv(cc.VARIABLE, "sm_80")
    elif not cc.converts_fp8(torch.device(device())):
        pytest.skip("this card has no fp8 conversion")
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, span, head_dim = shape
    k, v = cache_views(gen, batch, kv_heads, span, head_dim, torch.float8_e4m3fn,
                       "heads first" if span % 2 else "slots first")
    k_scale, v_scale = scale_views(gen, batch, kv_heads)
    q = queries(gen, batch, heads, head_dim, dtype)
    scale = head_dim ** -0.5
    for where in (span // 2, span - 1):
        slot = torch.tensor(where, device=device())
        pad = pads_for(gen, batch, where)
        ref = float64_reference(q, k, v, pad, slot, scale, k_scale, v_scale)
        for splits in (None, 5):
            got = da.decode_attention(q, k, v, pad, slot, scale, k_scale=k_scale,
                                      v_scale=v_scale, splits=splits)
            assert got.shape == q.shape and got.dtype == dtype
            torch.testing.assert_close(got.double(), ref, **tolerance(dtype),
                                       msg=lambda m, s=seed, w=where, n=splits:
                                       f"seed {s}, slot {w}, splits {n}: {m}")
            again = da.decode_attention(q, k, v, pad, slot, scale, k_scale=k_scale,
                                        v_scale=v_scale, splits=splits)
            assert torch.equal(got, again), (seed, where, splits)


@pytest.mark.parametrize("dtype", dtypes())
def test_nothing_leaks_from_outside_the_visible_slots(poisoned, dtype):
    """Slots before pad[b] and after slot hold NaN, inf and huge values, in k and v: the
    output is the same bits as with a clean cache, and finite."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, span, head_dim = 3, 6, 2, 90, 16
    k, v = cache_views(gen, batch, kv_heads, span, head_dim, dtype, "heads first")
    q = queries(gen, batch, heads, head_dim, dtype)
    slot = torch.tensor(61, device=device())
    pad = torch.tensor([0, 7, 58], device=device())
    for splits in (None, 1, 7):
        clean = da.decode_attention(q, k, v, pad, slot, 0.25, splits=splits)
        dirty_k, dirty_v = k.clone(), v.clone()
        for b, first in enumerate(pad.tolist()):
            for i, bad in enumerate((float("nan"), float("inf"), -1e30, 3e38)):
                dirty_k[b, :, i:first:4] = bad
                dirty_v[b, :, i:first:4] = -bad
                dirty_k[b, :, 62 + i::4] = -bad
                dirty_v[b, :, 62 + i::4] = bad
        dirty = da.decode_attention(q, dirty_k, dirty_v, pad, slot, 0.25, splits=splits)
        assert torch.isfinite(dirty).all(), (seed, splits)
        assert torch.equal(dirty, clean), (seed, splits)


def test_out_of_range_pad_and_slot_act_as_the_mask_does(poisoned):
    """Cannot happen in use, but must neither read past the view nor give NaN: a slot past
    the span sees up to its end, a negative pad from 0, pad > slot nothing (0, not 0 / 0)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    k, v = cache_views(gen, 3, 1, 40, 16, torch.float32, "heads first")
    q = queries(gen, 3, 2, 16, torch.float32)
    pad = torch.tensor([30, -4, 6], device=device())
    for where, splits in ((20, 3), (45, None), (1000, 4)):
        slot = torch.tensor(where, device=device())
        got = da.decode_attention(q, k, v, pad, slot, 0.25, splits=splits)
        live = pad.clamp(min=0) <= min(where, 39)
        assert torch.equal(got[~live], torch.zeros_like(got[~live])), (seed, where)
        ref = float64_reference(q, k, v, pad, slot, 0.25)[live]
        torch.testing.assert_close(got[live].double(), ref, **tolerance(torch.float32),
                                   msg=lambda m, w=where: f"seed {seed}, slot {w}: {m}")


def test_launch_policy_fills_the_card_within_the_span():
    """About 3 programs per SM, never more splits than the span has 32-slot tiles."""
    assert da.launch_shape(512, 16 * 4, 132) == (7, 64)  # 7B at batch 16: 448 programs
    assert da.launch_shape(256, 16 * 4, 132) == (7, 32)
    assert da.launch_shape(64, 16 * 4, 132) == (2, 32)
    assert da.launch_shape(8192, 1 * 2, 132) == (da.MAX_SPLITS, 64)
    assert da.launch_shape(1024, 64 * 8, 132) == (1, 64)
    assert da.launch_shape(1, 4, 4) == (1, 32)
    for span in (1, 40, 300, 1300):
        for rows in (1, 8, 64, 500):
            splits, block = da.launch_shape(span, rows, 132)
            assert 1 <= splits <= min(da.MAX_SPLITS, -(-span // 32)) and block in (32, 64)


def test_refuses_what_it_cannot_run():
    dev = device()

    def rand(*shape):
        return torch.randn(shape, device=dev)

    q, k = rand(2, 4, 1, 16), rand(2, 2, 8, 16)
    pad, slot = torch.zeros(2, dtype=torch.long, device=dev), torch.tensor(3, device=dev)
    bad = [
        ("head_dim must be a power of two", (rand(2, 4, 1, 24), rand(2, 2, 8, 24))),
        ("head_dim must be a power of two", (rand(2, 4, 1, 8), rand(2, 2, 8, 8))),
        ("H % KVH", (rand(2, 6, 1, 16), rand(2, 4, 8, 16))),
        (r"q must be \[B, H, 1, D\]", (rand(2, 4, 2, 16), k)),
        ("does not match q", (q, rand(3, 2, 8, 16))),
        ("does not match q", (q, rand(2, 2, 8, 32))),
        ("k and v caches must both be", (q, k, rand(2, 2, 9, 16))),
        ("stride 1", (q, rand(2, 2, 16, 8).transpose(2, 3))),
        ("share strides", (q, k, rand(2, 8, 2, 16).transpose(1, 2))),
        ("share a dtype", (q.double(), k)),
        ("pad must be", (q, k, k, pad[:1])),
        ("pad must be", (q, k, k, pad.int())),
        ("slot must be a 0-dim", (q, k, k, pad, slot[None])),
    ]
    for cause, args in bad:
        q_, k_, v_, pad_, slot_ = (*args, *(k, k, pad, slot)[len(args) - 1:])
        if len(args) == 2:
            v_ = k_
        with pytest.raises(ValueError, match=cause):
            da.decode_attention(q_, k_, v_, pad_, slot_, 0.25)
    k8 = k.to(torch.float8_e4m3fn)
    scales = torch.ones(2, 2, device=dev)
    bad_fp8 = [
        ("an fp8 cache comes with k and v scales", (k8, k8, {})),
        ("an fp8 cache comes with k and v scales", (k8, k8, {"k_scale": scales})),
        ("an fp8 cache comes with k and v scales", (k, k, {"k_scale": scales,
                                                           "v_scale": scales})),
        ("must share a dtype", (k8, k, {"k_scale": scales, "v_scale": scales})),
        (r"scales must be \[B, KVH\]", (k8, k8, {"k_scale": scales[:1],
                                                "v_scale": scales[:1]})),
        (r"scales must be \[B, KVH\]", (k8, k8, {"k_scale": scales.double(),
                                                "v_scale": scales})),
    ]
    for cause, (k_, v_, given) in bad_fp8:
        with pytest.raises(ValueError, match=cause):
            da.decode_attention(q, k_, v_, pad, slot, 0.25, **given)
    with pytest.raises(ValueError, match="q must be fp32, bf16 or fp16"):
        da.decode_attention(q.double(), k8, k8, pad, slot, 0.25, k_scale=scales,
                            v_scale=scales)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["q's dtype", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_replays_in_a_cuda_graph_at_a_later_slot(dtype, cache):
    """Captured at one slot, replayed after slot.fill_(later): the reference at the later
    slot (slot is read on the device, never on the host); an fp8 cache's scales too."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, span, head_dim = 4, 28, 4, 300, 128
    fp8 = cache == "fp8"
    k, v = cache_views(gen, batch, kv_heads, span, head_dim,
                       torch.float8_e4m3fn if fp8 else dtype, "heads first")
    scales = dict(zip(("k_scale", "v_scale"), scale_views(gen, batch, kv_heads),
                      strict=True)) if fp8 else {}
    q = queries(gen, batch, heads, head_dim, dtype)
    pad = torch.tensor([0, 5, 40, 100], device="cuda")
    slot = torch.tensor(120, device="cuda")
    scale = head_dim ** -0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        da.decode_attention(q, k, v, pad, slot, scale, **scales)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = da.decode_attention(q, k, v, pad, slot, scale, **scales)
    for later in (121, 255, span - 1):
        slot.fill_(later)
        graph.replay()
        torch.cuda.synchronize()
        ref = float64_reference(q, k, v, pad, slot, scale, **scales)
        torch.testing.assert_close(captured.double(), ref, **tolerance(dtype),
                                   msg=lambda m, s=seed, w=later: f"seed {s}, slot {w}: {m}")
        assert torch.equal(captured, da.decode_attention(q, k, v, pad, slot, scale,
                                                         **scales)), seed
