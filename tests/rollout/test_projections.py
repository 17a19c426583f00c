"""The decode step's dense groups: frozen q/k/v and gate/up re-pointed into one buffer each
(qerl.rollout.projections.merge_dense), so that a step runs each group as one GEMM; and a
prefill's groups, their adapters as GEMMs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qerl.kernels import lora_decode
from qerl.policy import build_policy
from qerl.rollout import Engine
from qerl.rollout.projections import _dense_group, lora_parts, merge_dense, project
from tests.conftest import fresh_seed
from tests.test_policy import randomize_adapter


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_frozen_group_becomes_views_of_one_buffer_and_computes_the_same(tiny_model_dir):
    """The engine merges a LoRA policy's frozen bases (Qwen2: with biases); the model's own
    forward, the fused projections and in-place writes see the same values as before."""
    seed = fresh_seed()
    policy = build_policy("lora", tiny_model_dir)
    randomize_adapter(policy, seed)
    ids = torch.tensor([[5, 9, 33, 2, 7]])
    with torch.no_grad():
        before = policy.model(ids).logits
    Engine(policy, max_batch=2, max_seq_len=16, fused=True)
    attn = policy.base_model.model.layers[0].self_attn
    bases = [attn.q_proj.base_layer, attn.k_proj.base_layer, attn.v_proj.base_layer]
    assert len({storage(b.weight) for b in bases}) == 1
    assert len({storage(b.bias) for b in bases}) == 1
    with torch.no_grad():
        assert torch.equal(policy.model(ids).logits, before), seed
    x = torch.randn(3, attn.q_proj.in_features, generator=torch.Generator().manual_seed(seed))
    x = x.to(bases[0].weight.dtype)
    with torch.no_grad():
        grouped = _dense_group(bases, x)
        for out, base in zip(grouped, bases, strict=True):
            assert torch.allclose(out.float(), base(x).float(), atol=1e-2, rtol=1e-2), seed
        bases[1].weight.mul_(2)  # an in-place write reaches the group's GEMM
        assert torch.allclose(_dense_group(bases, x)[1].float(), bases[1](x).float(),
                              atol=2e-2, rtol=1e-2), seed
        lora = project([attn.q_proj, attn.k_proj, attn.v_proj], x)
        for out, module in zip(lora, [attn.q_proj, attn.k_proj, attn.v_proj], strict=True):
            assert torch.allclose(out.float(), module(x).float(), atol=2e-2, rtol=1e-2), seed


def test_a_replaced_weight_is_never_read_from_the_stale_buffer():
    """A module whose weight was replaced after the merge (load_state_dict(assign=True), a
    user's own code) leaves the group: its GEMM reads the new weight, not the old rows."""
    layers = [nn.Linear(8, n, bias=False).requires_grad_(False) for n in (4, 2, 2)]
    merge_dense(layers)
    assert _dense_group(layers, torch.ones(1, 8)) is not None
    layers[1].weight = nn.Parameter(torch.zeros(2, 8), requires_grad=False)
    assert _dense_group(layers, torch.ones(1, 8)) is None


def test_an_export_after_the_merge_writes_each_weight_whole(tiny_model_dir, tmp_path):
    """A vLLM export of a LoRA policy writes its BF16 base, whose q/k/v are now views of one
    buffer: each is written whole, with its own values."""
    from safetensors import safe_open

    from qerl.export import export_for_vllm

    policy = build_policy("lora", tiny_model_dir)
    q = policy.base_model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    Engine(policy, max_batch=2, max_seq_len=16, fused=True)
    out = export_for_vllm(policy, tmp_path / "vllm")
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = next(p for p in (out / "base").glob("*.safetensors")
                 if name in safe_open(p, "pt").keys())
    assert torch.equal(safe_open(shard, "pt").get_tensor(name), q.to(torch.bfloat16))


def test_trainable_or_mixed_groups_stay_as_they_are():
    """Full fine-tuning's weights train (a checkpoint of views would share storage), and a
    group of two dtypes or input sizes has no one GEMM."""
    trainable = [nn.Linear(8, 4), nn.Linear(8, 4)]
    mixed = [nn.Linear(8, 4).requires_grad_(False),
             nn.Linear(8, 4).to(torch.bfloat16).requires_grad_(False)]
    widths = [nn.Linear(8, 4).requires_grad_(False), nn.Linear(6, 4).requires_grad_(False)]
    for group in (trainable, mixed, widths):
        pointers = [storage(m.weight) for m in group]
        merge_dense(group)
        assert [storage(m.weight) for m in group] == pointers
        assert _dense_group(group, torch.ones(1, 8)) is None


@pytest.mark.parametrize("method", ["lora", "qerl"])
def test_a_prefill_group_adds_each_adapter_once_rounded(method, tiny_model_dir,
                                                        tiny_checkpoint):
    """More rows than the decode kernels take: each output is its base's plus scaling x
    A^T B^T, against float64 within the adapters' bf16 operands and one rounding, for
    merged BF16 bases and NVFP4 ones, q/k/v, gate/up through SiLU, and down."""
    seed = fresh_seed()
    policy = build_policy(method, tiny_model_dir if method == "lora" else tiny_checkpoint)
    randomize_adapter(policy, seed)
    Engine(policy, max_batch=2, max_seq_len=16, fused=True)  # merges LoRA's dense groups
    layer = policy.base_model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    gen = torch.Generator().manual_seed(seed)
    rows = lora_decode.MAX_ROWS + 7

    def reference(module, x):
        """float64 base + adapter, and a bound on the rounding of x A^T, A, B, the merged
        base and the sum: 2^-8 of what each carries (magnitudes, so that cancellation
        inside the adapter does not shrink it)."""
        p = lora_parts(module)
        x, a, b, base = x.double(), p.a.double(), p.b.double(), p.base(x).double()
        adapter = p.scaling * x @ a.T @ b.T
        carried = p.scaling * x.abs() @ a.abs().T @ b.abs().T
        ref = base + adapter
        return ref, adapter, 2.0 ** -8 * (ref.abs() + base.abs() + 3 * carried)

    def check(got, ref, adapter, bound):
        assert ((got.double() - ref).abs() <= bound).all(), seed
        assert (adapter.abs() > 10 * bound).any(), seed  # a lost adapter would show

    with torch.no_grad():
        x = torch.randn(rows, attn.q_proj.in_features, generator=gen).to(torch.bfloat16)
        for out, module in zip(project([attn.q_proj, attn.k_proj, attn.v_proj], x),
                               [attn.q_proj, attn.k_proj, attn.v_proj], strict=True):
            check(out, *reference(module, x))
        (act,) = project([mlp.gate_proj, mlp.up_proj], x, silu_mul=True)
        (gate, *_), (up, *_) = (reference(m, x) for m in (mlp.gate_proj, mlp.up_proj))
        ref = torch.nn.functional.silu(gate) * up
        assert torch.allclose(act.double(), ref, rtol=2.0 ** -6,
                              atol=2.0 ** -8 * ref.abs().max().item()), seed
        h = torch.randn(rows, mlp.down_proj.in_features, generator=gen).to(torch.bfloat16)
        check(project([mlp.down_proj], h)[0], *reference(mlp.down_proj, h))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams and graphs")
def test_the_shrink_takes_a_side_stream_only_inside_a_captured_graph(tiny_model_dir,
                                                                     monkeypatch):
    """Eager (a prefill of few rows: the host's launches set its time) everything runs on
    one stream; while the decode step's graph is captured the shrink is a side branch
    beside the bases. The replay computes what the eager pass did."""
    from qerl.rollout import projections

    policy = build_policy("lora", tiny_model_dir, device="cuda")
    randomize_adapter(policy, fresh_seed())
    Engine(policy, max_batch=2, max_seq_len=16, fused=True)
    attn = policy.base_model.model.layers[0].self_attn
    modules = [attn.q_proj, attn.k_proj, attn.v_proj]
    streams = []  # (the stream the shrink ran on, the one its caller is on)
    shrink = lora_decode.lora_shrink
    monkeypatch.setattr(lora_decode, "lora_shrink", lambda *a: streams.append(
        torch.cuda.current_stream()) or shrink(*a))
    x = torch.randn(4, attn.q_proj.in_features, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        eager = [out.clone() for out in project(modules, x)]
        assert streams == [torch.cuda.current_stream()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = project(modules, x)
        assert streams[1:] == [projections._side_stream(x.device)]
        graph.replay()
        torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert torch.equal(got, want)
