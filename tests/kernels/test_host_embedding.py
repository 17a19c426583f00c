"""The host-memory embedding gather against torch's indexing of the table, in float64: a
gather only copies (and casts), so it is exact. Under Triton's CPU interpreter on odd
shapes; on a GPU (marked) from a pinned table over PCIe, eagerly, replayed from a CUDA
graph with other ids, and through the operator under torch.compile."""

from __future__ import annotations

import pytest
import torch

from qerl.kernels import host_embedding as he
from qerl.kernels.device_facts import interpreting
from tests.conftest import fresh_seed

needs_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="no GPU and no interpreter")
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def reference(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table[ids] in float64, through the output's dtype (a cast rounds once)."""
    return table[ids.cpu().long()].to(dtype).double()


def make(gen, vocab: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    table = torch.randn(vocab, dim, generator=gen).to(dtype)
    return table.pin_memory() if torch.cuda.is_available() else table


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def out_dtypes(dtype: torch.dtype) -> list[torch.dtype | None]:
    """The table's own dtype; an upcast (exact); a downcast on a GPU only (the interpreter
    truncates fp32 -> bf16 where the GPU and torch round to nearest even)."""
    if dtype == torch.bfloat16:
        return [None, torch.float32]
    return [None] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@needs_kernels
@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("vocab", "dim"), [(1000, 72), (300, 4096 + 40), (7, 1)])
@pytest.mark.parametrize("ids_shape", [(3, 5), (11,)])
def test_gathers_the_rows(poisoned, table_dtype, vocab, dim, ids_shape):
    """Ids [B, T] and [N], int64 and int32 (every row of the table reachable, the last one
    included); the output starts as NaN (``poisoned``), so an unwritten element fails."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    table = make(gen, vocab, dim, table_dtype)
    ids = torch.randint(0, vocab, ids_shape, generator=gen)
    ids.view(-1)[0] = vocab - 1
    for id_dtype in (torch.int64, torch.int32):
        for dtype in out_dtypes(table_dtype):
            got = he.gather_rows(table, ids.to(id_dtype).to(device()), dtype)
            assert got.shape == (*ids_shape, dim)
            assert got.dtype == (dtype or table_dtype)
            assert got.device.type == device()
            assert torch.equal(got.double().cpu(), reference(table, ids, got.dtype)), seed


@needs_kernels
def test_strided_and_empty_ids(poisoned):
    """A column slice of ids (not contiguous); no ids at all, in either shape."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    table = make(gen, 50, 24, torch.float32)
    ids = torch.randint(0, 50, (4, 9), generator=gen).to(device())[:, 1::2]
    assert torch.equal(he.gather_rows(table, ids).cpu(), table[ids.cpu()]), seed
    for shape in ((0,), (2, 0)):
        empty = he.gather_rows(table, torch.zeros(shape, dtype=torch.long, device=device()))
        assert empty.shape == (*shape, 24)


@needs_kernels
def test_the_operator_is_the_eager_gather():
    """``qerl::host_embedding``, which torch.compile traces, gives what the eager launch
    gives; its fake implementation the same shape, dtype and device."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    table = make(gen, 100, 40, torch.bfloat16)
    ids = torch.randint(0, 100, (2, 3), generator=gen).to(device())
    op = torch.ops.qerl.host_embedding(table, ids, torch.float32)
    assert torch.equal(op, he.gather_rows(table, ids, torch.float32)), seed
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.qerl.host_embedding(mode.from_tensor(table), mode.from_tensor(ids),
                                             None)
    assert (fake.shape, fake.dtype, fake.device) == (op.shape, torch.bfloat16, op.device)


@pytest.mark.skipif(not interpreting(), reason="opcheck copies its inputs, and a copy of a "
                    "pinned table is not pinned: a GPU gather refuses it")
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_the_operator_passes_opcheck(dtype):
    gen = torch.Generator().manual_seed(fresh_seed())
    table = torch.randn(100, 40, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 3), generator=gen)
    torch.library.opcheck(torch.ops.qerl.host_embedding.default, (table, ids, dtype))


@pytest.mark.parametrize(("table", "ids", "cause"), [
    (torch.zeros(10, 4), torch.zeros(3), "ids must be integers"),
    (torch.zeros(10, 4), torch.zeros(3, dtype=torch.bool), "ids must be integers"),
    (torch.zeros(40), torch.zeros(3, dtype=torch.long), "must be 2-D"),
    (torch.zeros(4, 10).T, torch.zeros(3, dtype=torch.long), "rows must be contiguous"),
])
def test_refuses_bad_inputs(table, ids, cause):
    with pytest.raises((TypeError, ValueError), match=cause):
        he.gather_rows(table, ids)


def test_refuses_cpu_ids_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton's interpreter"):
        he.gather_rows(torch.zeros(10, 4), torch.zeros(3, dtype=torch.long))


@pytest.mark.gpu
@GPU
def test_refuses_a_table_not_in_pinned_host_memory():
    ids = torch.zeros(3, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match=r"must be in pinned memory \(tensor.pin_memory\(\)\)"):
        he.gather_rows(torch.zeros(10, 4), ids)
    with pytest.raises(ValueError, match="is on cuda:0, not in host memory"):
        he.gather_rows(torch.zeros(10, 4, device="cuda"), ids)


@pytest.mark.gpu
@GPU
def test_replays_in_a_cuda_graph_from_a_pinned_table():
    """Qwen2.5-7B's table (152064 x 3584 bf16) pinned on the host, none of it on the GPU;
    captured on one batch of ids, replayed on others copied into the same buffer; a
    compiled caller (fullgraph, through the operator) gathers the same rows."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    before = torch.cuda.memory_allocated()
    table = torch.empty(152064, 3584, dtype=torch.bfloat16, pin_memory=True)
    table.copy_(torch.randn(152064, 3584, generator=gen))
    assert torch.cuda.memory_allocated() == before
    ids = torch.randint(0, 152064, (64, 1), generator=gen).cuda()
    assert torch.equal(he.gather_rows(table, ids).cpu(), table[ids.cpu()]), seed
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        he.gather_rows(table, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = he.gather_rows(table, ids)
    for _ in range(3):
        new = torch.randint(0, 152064, (64, 1), generator=gen)
        ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.cpu(), table[new]), seed
    small = table[:1000]  # a view: still pinned host memory
    some = torch.randint(0, 1000, (5, 7), generator=gen).cuda()
    compiled = torch.compile(lambda i: he.gather_rows(small, i, torch.float32) * 2,
                             fullgraph=True)
    assert torch.equal(compiled(some).cpu(), small[some.cpu()].float() * 2), seed
