"""Rows of an embedding table in pinned host memory, gathered into a GPU tensor by one
kernel that reads the table over PCIe (zero-copy).

Under CUDA's unified addressing a pinned (page-locked) host tensor's address is valid on
the device, so a kernel can load from it directly; only the rows asked for cross the bus.
With the ids already on the GPU the gather is one launch and no host sync: it can be
captured in a CUDA graph, and the table costs no GPU memory. The kernel is also the PyTorch
operator ``qerl::host_embedding`` (its fake implementation here), which torch.compile and
fake tensors see.

Ids must lie in [0, rows of the table). They are not checked: that would need the ids on
the host, a sync. As with torch's CUDA embedding, an id out of range is undefined (here a
read of whatever host memory lies there, or a fault).

On the CPU, under Triton's interpreter (TRITON_INTERPRET=1), the same kernel gathers from
an ordinary host tensor into a CPU output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl.kernels.device_facts import interpreting

PINNED = "the host embedding table must be in pinned memory (tensor.pin_memory())"


@triton.jit
def gather_rows_kernel(ids_ptr, table_ptr, out_ptr, D, stride_t, stride_o,
                       BLOCK: tl.constexpr):
    # Grid: (rows of out, blocks of BLOCK columns); rows on axis 0, which allows 2^31 - 1
    # programs where the others allow 65535.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    # int64: vocab x dim may pass 2^31 elements.
    at = tl.load(ids_ptr + row).to(tl.int64)
    x = tl.load(table_ptr + at * stride_t + cols, mask=ok)
    tl.store(out_ptr + row * stride_o + cols, x.to(out_ptr.dtype.element_ty), mask=ok)


def check(table: torch.Tensor, ids: torch.Tensor) -> None:
    """Refuse, naming the cause, what ``gather_rows`` cannot gather."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"embedding ids must be integers, got {ids.dtype}")
    if table.dim() != 2:
        raise ValueError(f"the embedding table must be 2-D [vocab, dim], got shape "
                         f"{tuple(table.shape)}")
    if table.device.type != "cpu":
        raise ValueError(f"the host embedding table is on {table.device}, not in host memory")
    if table.shape[1] and table.stride(1) != 1:
        # A contiguous copy would be pageable host memory, and as large as the table.
        raise ValueError(f"the embedding table's rows must be contiguous (strides "
                         f"{table.stride()})")
    if ids.device.type == "cuda":
        # Asking the driver about the table during a CUDA graph's capture is not needed:
        # a capture follows eager runs of the same step (the engine's warm-up), which did.
        if not torch.cuda.is_current_stream_capturing() and not table.is_pinned():
            raise ValueError(PINNED)
    elif ids.device.type != "cpu" or not interpreting():
        raise ValueError(f"the gather runs on a CUDA device, or on the CPU under Triton's "
                         f"interpreter (TRITON_INTERPRET=1); the ids are on {ids.device}")


def gather_rows(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None
                ) -> torch.Tensor:
    """table[ids] on the ids' device, in ``dtype`` (default: the table's): table [V, D] in
    host memory (pinned where the ids are on a GPU), ids of any shape -> [*ids.shape, D].
    Traced by torch.compile as the operator ``qerl::host_embedding``; eagerly Triton's own
    launch, without an operator's dispatch."""
    if torch.compiler.is_compiling():
        # The tracer's fake tensors are not pinned: the operator checks when it runs.
        return torch.ops.qerl.host_embedding(table, ids, dtype)
    check(table, ids)
    return _gather(table, ids, dtype)


def _gather(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None
            ) -> torch.Tensor:
    d = table.shape[1]
    flat = ids.reshape(-1)  # a copy only for strided ids, on their device: no sync
    out = torch.empty((flat.numel(), d), dtype=dtype or table.dtype, device=ids.device)
    if out.numel():
        # One program loads BLOCK contiguous elements of a row: a whole row for narrow
        # tables, several programs a row for wide ones, so that many reads are in flight
        # over the bus at once. The cap and num_warps are a first choice, not yet swept
        # on a GPU.
        block = min(triton.next_power_of_2(d), 1024)
        gather_rows_kernel[(flat.numel(), triton.cdiv(d, block))](
            flat, table, out, d, table.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*ids.shape, d)


@torch.library.custom_op("qerl::host_embedding", mutates_args=())
def _host_embedding_op(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None
                       ) -> torch.Tensor:
    check(table, ids)
    return _gather(table, ids, dtype)


@_host_embedding_op.register_fake
def _fake(table, ids, dtype):
    """[*ids.shape, D] on the ids' device, in ``dtype`` or the table's."""
    return ids.new_empty((*ids.shape, table.shape[1]), dtype=dtype or table.dtype)
