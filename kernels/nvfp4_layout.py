"""The kernels' layout of packed NVFP4 codes: pair-interleaved, in tiles of 16 rows.

compressed-tensors packs the codes of a row in order, element 2i in the low nibble of byte
i, so 16 bytes hold 32 consecutive weights with their two groups of 16 mixed across the
nibbles. The kernels want each nibble of a 16-byte chunk to be one whole group:

    chunk p of row n, byte j = code[n, 32 p + j] | code[n, 32 p + 16 + j] << 4    (j < 16)

so that the low nibbles of chunk p are group 2p and the high nibbles group 2p + 1. Both
halves then decode elementwise, straight into a tensor-core operand, each with one scale,
and multiply contiguous activations. The compressed-tensors order would make a kernel split
the activations into even and odd columns and pick a scale per weight (kernels/DESIGN.md,
"nvfp4_layout").

The chunks are stored in tiles of 16 rows by four chunks (64 bytes, 128 weights), each
tile's 1 KB contiguous, tiles in row-major order:

    tiles[n // 16, p // 4, n % 16, 16 (p % 4) + j]          shape [N/16, K/128, 16, 64]

which is exactly what one warp of the CUDA kernel reads per step (its 16-row strip, four
chunks): 512 contiguous bytes per load instruction instead of 64 bytes from each of 8 rows.
Rows past N and weights past K (N rounded up to 16, K to 128) hold zero codes.

Last, the bits of each 32-bit word (bytes 4w .. 4w + 3 of a chunk, little-endian) are
shuffled so that a kernel (the CUDA one and the Triton ones) turns a word into four bf16
pairs with 8 instructions, where a byte-wise decode of unshuffled nibbles takes 14: its eight
codes L0-L3 (low nibbles, weights 32p + 4w + i) and H0-H3 (high nibbles, 32p + 16 + 4w + i)
sit where

    (L0, L1) = w & M              (L2, L3) = rotl(w, 10) & M
    (H0, H1) = rotl(w, 13) & M    (H2, H3) = ((w & 0x001B001B) * 0x1084) & M

put each code's magnitude at bits 6-8 and its sign at bit 15 of a 16-bit half (M =
0x81C081C0: the E2M1 value * 2^-126 as bf16). A search over rotations, byte permutes and
multiply-by-shifted-copies found no cheaper cover of the word (kernels/DESIGN.md,
"nvfp4_layout"). The permutation is done once, when a layer is built; it is exact and
reversible (``from_pairs``). The scales keep the checkpoint's [N, K/16] layout.
"""

from __future__ import annotations

import torch

from qerl.errors import QuantizationError
from qerl.formats import nvfp4

PAIR = 2 * nvfp4.GROUP_SIZE  # weights per 16-byte chunk
TILE_ROWS = 16  # rows of a tile
TILE_WEIGHTS = 4 * PAIR  # weights of a row in a tile (four chunks, 64 bytes)

# The decode above: the mask that leaves each 16-bit half's magnitude (bits 6-8) and sign
# (bit 15), the left rotations that bring (L2, L3) and (H0, H1) under it, and the mask and
# multiplier (three shifted copies, no carries) that bring (H2, H3).
CODE_BITS = 0x81C081C0
ROTATIONS = (10, 13)
SPREAD = (0x001B001B, 0x1084)
# Bit positions in a word of codes L0, L1, L2, L3, H0, H1, H2, H3, each as (mantissa,
# exponent low, exponent high, sign): the decode above reads them from there.
WORD_BITS = ((6, 7, 8, 15), (22, 23, 24, 31), (28, 29, 30, 5), (12, 13, 14, 21),
             (25, 26, 27, 2), (9, 10, 11, 18), (4, 0, 1, 3), (20, 16, 17, 19))


def _moves(to_word: bool) -> tuple[tuple[int, int], ...]:
    """The shuffle (or its inverse) as (mask, left rotation) pairs, one per distance moved:
    the bits of ``mask`` all move by the same rotation."""
    moves: dict[int, int] = {}
    for code, bits in enumerate(WORD_BITS):
        byte, nibble = code % 4, code // 4  # L_b and H_b share byte b
        for bit, new in enumerate(bits):
            old = 8 * byte + 4 * nibble + bit
            src, dst = (old, new) if to_word else (new, old)
            moves[(dst - src) % 32] = moves.get((dst - src) % 32, 0) | 1 << src
    return tuple((mask, shift) for shift, mask in sorted(moves.items()))


TO_WORD, FROM_WORD = _moves(True), _moves(False)


def _permute_words(packed: torch.Tensor, moves: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Each 32-bit word of a contiguous uint8 tensor (last dim a multiple of 4) moved bit by
    bit: the OR of its ``mask`` bits rotated left by ``shift``, over ``moves``."""
    words = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(words)
    for mask, shift in moves:
        bits = words & mask
        out |= ((bits << shift) | (bits >> (32 - shift))) & 0xFFFFFFFF
    out = torch.where(out >= 1 << 31, out - (1 << 32), out)  # as int32's two's complement
    return out.to(torch.int32).view(torch.uint8)


def tiles_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """Shape of the tiled layout for an [N, K] weight."""
    return (-(-n // TILE_ROWS), -(-k // TILE_WEIGHTS), TILE_ROWS, TILE_WEIGHTS // 2)


def to_pairs(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors packing [N, K/2] -> pair-interleaved tiles (tiles_shape(N, K))."""
    n, k = packed.shape[0], packed.shape[1] * 2
    row_tiles, quads, rows, width = tiles_shape(n, k)
    codes = nvfp4.unpack(packed)
    codes = torch.nn.functional.pad(codes, (0, quads * TILE_WEIGHTS - k,
                                            0, row_tiles * rows - n))
    halves = codes.reshape(row_tiles * rows, -1, 2, nvfp4.GROUP_SIZE)
    pairs = halves[:, :, 0] | (halves[:, :, 1] << 4)
    tiles = pairs.reshape(row_tiles, rows, quads, width).transpose(1, 2).contiguous()
    return _permute_words(tiles, TO_WORD)


def from_pairs(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pair-interleaved tiles -> compressed-tensors packing [N, K/2]."""
    check_pairs_shape(tiles, n, k)
    row_tiles, quads, rows, width = tiles.shape
    pairs = _permute_words(tiles, FROM_WORD).transpose(1, 2)
    pairs = pairs.reshape(row_tiles * rows, quads * width)[:n]
    chunks = pairs.reshape(n, -1, 1, nvfp4.GROUP_SIZE)
    codes = torch.cat((chunks & 0xF, chunks >> 4), dim=2).reshape(n, -1)[:, :k]
    return nvfp4.pack(codes)


def check_pairs_shape(tiles: torch.Tensor, n: int, k: int) -> None:
    if tiles.dtype != torch.uint8 or tiles.dim() != 4:
        raise QuantizationError(f"pair-interleaved codes must be a 4-D uint8 tensor of tiles "
                                f"(nvfp4_layout.to_pairs), got {tiles.dtype} of shape "
                                f"{tuple(tiles.shape)}")
    if tiles.shape != tiles_shape(n, k):
        raise QuantizationError(f"pair-interleaved codes for an [{n}, {k}] weight need tiles "
                                f"of shape {tiles_shape(n, k)}, got {tuple(tiles.shape)}")
    _, quads, rows, width = tiles.shape
    dense = (quads * rows * width, rows * width, width, 1)
    if any(size > 1 and got != want
           for size, got, want in zip(tiles.shape, tiles.stride(), dense, strict=True)):
        raise QuantizationError(f"the tiles of the codes must be contiguous, got strides "
                                f"{tiles.stride()} for shape {tuple(tiles.shape)}")


def check_layer(pairs: torch.Tensor, scale: torch.Tensor,
                global_scale: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a weight given as pair-interleaved tiles + scales (N = scale rows, K = 16 x
    scale columns); QuantizationError unless the three tensors fit together."""
    if scale.dim() != 2:
        raise QuantizationError(f"weight_scale must be 2-D, got shape {tuple(scale.shape)}")
    n, k = scale.shape[0], scale.shape[1] * nvfp4.GROUP_SIZE
    nvfp4.check_scales(scale, global_scale, n, k)
    check_pairs_shape(pairs, n, k)
    return n, k


def gemm_order(x: torch.Tensor, quads: int) -> torch.Tensor:
    """x [M, K] -> [M, 128 * quads] (zeros past K) with each 128 columns in the order the
    Hopper GEMM's k steps read them (nvfp4_gemm.cu): step 2w + h holds, for t = 0..3, pair
    h of word w of chunk t's low group (k slots 2t, 2t + 1) and of its high group (slots 8 +
    2t, 8 + 2t + 1). In index terms column 32t + 16hi + 4w + 2h + e moves to 16(2w + h) + 8hi
    + 2t + e. wgmma reads B from shared memory in its own k order while the decoded weight's
    register fragment holds four consecutive k of one chunk a thread, so x follows W."""
    m, k = x.shape
    x = torch.nn.functional.pad(x, (0, quads * TILE_WEIGHTS - k))
    return x.view(m, quads, 4, 2, 4, 2, 2).permute(0, 1, 4, 5, 3, 2, 6).reshape(m, -1)


GEMM_TILE_COLUMNS = 64  # a row of x's tiles: 128 bytes, the span of wgmma's 128-byte swizzle


def gemm_tiles(x: torch.Tensor, quads: int, rows: int) -> torch.Tensor:
    """x [M, K] -> [quads, 2, rows, 64]: ``gemm_order``'s columns, each quad's two halves of
    64 as tiles of ``rows`` (>= M; zeros past M) and within each row of a tile the eight
    16-byte chunks in the Hopper GEMM's swizzled order (chunk c of row r at c ^ r % 8, the
    layout wgmma reads with the 128-byte swizzle). A tile of BM rows is then one contiguous
    copy from HBM into shared memory, as the kernel's bulk copies need."""
    m = x.shape[0]
    if rows < m:
        raise QuantizationError(f"gemm_tiles needs rows >= M = {m}, got {rows}")
    ordered = torch.nn.functional.pad(gemm_order(x, quads), (0, 0, 0, rows - m))
    chunks = ordered.view(rows, quads, 2, 8, 8)
    r = torch.arange(rows, device=x.device)
    where = (torch.arange(8, device=x.device)[None, :] ^ (r % 8)[:, None])  # [rows, 8]
    swizzled = chunks[r[:, None], :, :, where]  # [rows, 8, quads, 2, 8]
    return swizzled.permute(2, 3, 0, 1, 4).reshape(quads, 2, rows, GEMM_TILE_COLUMNS)
