"""A tiny random Qwen2 whose input embedding moved to host memory (embedding_to_host) is the
model it was: the same logits, the same state_dict, the same LoRA gradients under gradient
checkpointing; its table stays on the host through model.to() and out of
model.parameters(). Tied or trained embeddings are refused by name. On a GPU (marked): the
table leaves GPU memory and the logits stay the same."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qerl.nn.host_embedding import HostEmbedding, HostEmbeddingError, embedding_to_host
from tests.conftest import fresh_seed, tiny_config

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
VOCAB = 1000


def tiny_model(seed: int, dtype=torch.bfloat16, tied=False, device="cpu"):
    from transformers import AutoModelForCausalLM

    config = tiny_config(tied=tied)
    config.vocab_size = VOCAB
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(device, dtype).eval()


def frozen_pair(seed: int, dtype=torch.bfloat16, device="cpu"):
    """(the model, an untouched copy); the model's embedding frozen and moved to host."""
    model = tiny_model(seed, dtype, device=device)
    ref = copy.deepcopy(model)
    model.get_input_embeddings().weight.requires_grad_(False)
    return model, ref, embedding_to_host(model)


def ids_for(seed: int, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 7), generator=gen).to(device)


def test_the_logits_are_the_models():
    seed = fresh_seed()
    model, ref, host = frozen_pair(seed)
    assert model.get_input_embeddings() is host and isinstance(host, HostEmbedding)
    assert (host.num_embeddings, host.embedding_dim, host.padding_idx) == (VOCAB, 64, None)
    ids = ids_for(seed)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits), seed


@pytest.mark.parametrize("move", [lambda m: m.to(torch.float32), lambda m: m.to("cpu"),
                                  lambda m: m.float(), lambda m: m.half()])
def test_to_leaves_the_table_and_casts_the_rows(move):
    """The table keeps its storage, dtype and device; the rows come out as an nn.Embedding
    moved alike would give them, so the logits follow the cast model's."""
    seed = fresh_seed()
    model, ref, host = frozen_pair(seed)
    table, ptr = host.weight, host.weight.data_ptr()
    move(model)
    move(ref)
    assert host.weight is table and host.weight.data_ptr() == ptr
    assert (table.dtype, table.device.type) == (torch.bfloat16, "cpu")
    assert host.dtype == ref.get_input_embeddings().weight.dtype
    ids = ids_for(seed)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits), seed


def test_the_state_dict_keeps_the_table_and_the_parameters_do_not():
    seed = fresh_seed()
    model, ref, host = frozen_pair(seed)
    state = model.state_dict()
    assert torch.equal(state["model.embed_tokens.weight"],
                       ref.state_dict()["model.embed_tokens.weight"])
    assert list(state) == list(ref.state_dict())
    assert not any(p is host.weight for p in model.parameters())
    assert "model.embed_tokens.weight" not in dict(model.named_parameters())
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.device == next(model.parameters()).device
    # Loading copies into the table in place: it stays the host buffer it was.
    ptr = host.weight.data_ptr()
    other = tiny_model(seed + 1)
    model.load_state_dict(other.state_dict())
    assert host.weight.data_ptr() == ptr
    assert torch.equal(host.weight, other.get_input_embeddings().weight)


def test_refuses_a_tied_or_trained_embedding_and_ids_elsewhere():
    seed = fresh_seed()
    tied = tiny_model(seed, tied=True)
    tied.get_input_embeddings().weight.requires_grad_(False)
    with pytest.raises(HostEmbeddingError, match="tie_word_embeddings"):
        embedding_to_host(tied)
    with pytest.raises(ValueError, match="requires grad"):  # a full fine-tune's
        embedding_to_host(tiny_model(seed))

    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 8

    with pytest.raises(HostEmbeddingError, match="to host memory, not Scaled"):
        HostEmbedding.from_embedding(Scaled(10, 4), "cpu")
    host = HostEmbedding.from_embedding(nn.Embedding(10, 4), "cpu")
    with pytest.raises(HostEmbeddingError, match="ids are on meta; the embedding computes"):
        host(torch.zeros(3, dtype=torch.long, device="meta"))


@pytest.mark.parametrize("hooks_first", [False, True])
def test_checkpointed_lora_gradients_are_the_models(hooks_first):
    """Reentrant checkpointing needs inputs that require grad: enable_input_require_grads'
    hook on the embedding gives them (gradient_checkpointing_enable makes it), whether it
    was made on the old embedding (carried over, still removable by its handle) or on the
    new one."""
    from peft import LoraConfig, get_peft_model

    seed = fresh_seed()
    ids = ids_for(seed)
    grads = []
    for move in (False, True):
        model = tiny_model(seed, torch.float32).train()
        peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                target_modules=["q_proj", "v_proj"]))
        gen = torch.Generator().manual_seed(seed)
        for name, p in sorted(peft.named_parameters()):
            if "lora_B" in name:  # PEFT starts B at zero, which would zero A's gradient
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        host = embedding_to_host(peft) if move and not hooks_first else None
        # transformers' gradient_checkpointing_enable calls enable_input_require_grads.
        peft.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": True})
        if move and hooks_first:
            host = embedding_to_host(peft)
        peft(ids, labels=ids).loss.backward()
        trained = {n: p.grad for n, p in peft.named_parameters() if p.requires_grad}
        assert trained and all(g is not None for g in trained.values()), seed
        grads.append(trained)
        if host is not None:
            assert host.weight.grad is None and not host.weight.requires_grad
            peft.disable_input_require_grads()
            assert not host._forward_hooks
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), (seed, name)


@pytest.mark.gpu
@GPU
def test_on_a_gpu_the_table_leaves_gpu_memory():
    """Moved to pinned host memory, the table's bytes leave the GPU; the gather from it
    over PCIe is exact, so the logits are the model's; model.device stays the GPU."""
    seed = fresh_seed()
    model = tiny_model(seed, device="cuda")
    ref = copy.deepcopy(model)
    model.get_input_embeddings().weight.requires_grad_(False)
    before = torch.cuda.memory_allocated()
    host = embedding_to_host(model)
    assert before - torch.cuda.memory_allocated() == VOCAB * 64 * 2
    assert host.weight.is_pinned() and host.device == torch.device("cuda", 0)
    assert model.device.type == "cuda"
    ids = ids_for(seed, "cuda")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits), seed
    model.cpu()  # the rows follow; the table stays where it is
    assert host.device.type == "cpu" and host.weight.is_pinned()
    with torch.no_grad():
        assert torch.equal(model(ids.cpu()).logits, ref.cpu()(ids.cpu()).logits), seed
