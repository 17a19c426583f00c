// Small-M NVFP4 matmul on tensor cores: out[S][M][N] = split-K partial sums of
// x[M, K] @ deq(W[N, K])^T, for M <= 32 (rollout decode steps), for up to three weights
// that read the same x side by side in N, and optionally the LoRA shrink of their fp32
// adapters (shrink_row) in the same launch. Built and loaded by nvfp4_gemv.py; the layout
// and the decode are the Triton kernels' (nvfp4_layout.py, nvfp4_triton.py), so both read
// the same packed weight.
//
// Why by hand: Triton stages W through shared memory and moves it into mma operand
// registers; those moves, its barriers and scale loads, which Triton gives no control over,
// bound the Triton kernel (kernels/DESIGN.md, "nvfp4_gemv"). Here W is mma's A operand (16
// rows of W x 16 of K) and x^T its B operand (K x 8 tokens), so each thread loads its own
// fragments with 16-byte loads straight into registers, and no layout change is needed at
// all: mma sums over K in any order, as long as A and B agree. Thread (g, t) of a warp
// (g = lane / 4, t = lane % 4) owns W rows g and g + 8 of its 16-row strip and token g of
// each 8-token tile; in a quad of chunks it reads chunk p = 4q + t (32 weights of each row:
// the 16 bytes of the pair-interleaved layout, whose 16-row tiles keep a strip's quad in
// 1 KB of memory) and the 32 activations x[token, 32p .. 32p + 31] that those weights
// multiply. One 32-bit word of a row's chunk holds codes 32p + 4w + {0..3} (L) and
// 32p + 16 + 4w + {0..3} (H), bytes 4w..4w+3 of the pair layout with their bits shuffled
// (nvfp4_layout). Two mma steps consume a word of row g and of row g + 8: the codes pair up
// with the contiguous activation pairs (x words) they multiply.
//
// What bounds it (shown by variants that read W or x from one place): not the bytes but the
// instructions around them and, above 8 rows, x's L1 traffic. The main loop therefore reads
// whole quads without bounds checks (the last, partial quad has its own loop), two chunks
// of W stay in flight per warp in registers, and above 8 rows x is staged once per block in
// shared memory (a quad ahead, cp.async) instead of each warp loading it through L1.
//
// Decode (decode_word): the layout shuffles each word's bits so that its eight codes come
// out as four 16-bit pairs with one mask, two rotate + mask and one mask + multiply + mask
// (8 instructions; a byte spread by prmt, then mask + multiply + mask per pair, is 14),
// each a bf16 E2M1 * 2^-126; one packed multiply by the group scale (fp8 -> bf16 * 2^64,
// exact) gives the exact weight * scale * 2^-62, and the fp32 accumulator is multiplied by
// 2^62 / global_scale once at the end. fp16 places the magnitude at bits 9-11 (E2M1 *
// 2^-14).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "nvfp4_decode.cuh"
#include "torch_op.cuh"

namespace {

using namespace qerl;

constexpr int kWarps = 4;  // per block; they split the block's rows and/or its K range

// W streams through once: keep it out of L1, where x (read by every warp) lives.
__device__ __forceinline__ Vec4 load_stream(const uint8_t* p) {
  Vec4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3])
      : "l"(p));
  return r;
}

__device__ __forceinline__ Vec4 load_cached(const uint16_t* p) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  return Vec4{{u.x, u.y, u.z, u.w}};
}

// One pipeline stage: a thread's two rows of one chunk, and their four group scales
// (byte 0: group 2p, byte 1: group 2p + 1).
struct Stage {
  Vec4 w[2];
  uint32_t s[2];
};

// x for M > 8 goes through shared memory, 16 bytes at a time (cp.async: no registers held
// while in flight). Piece c (of 16) of token tok's 256 bytes of a quad is stored at c ^
// ((tok & 1) * 2 + c / 8): the eight 16-byte reads of a quarter warp (tokens g, g + 1;
// t = 0..3; the same half e) then fall in eight different bank groups.
__device__ __forceinline__ int swizzle(int tok, int c) { return c ^ ((tok & 1) * 2 + (c >> 3)); }

template <bool BF16>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// One weight of a launch. A launch runs up to kMaxMembers weights that share x (q/k/v,
// gate/up): one launch instead of three, and the small ones (k, v) ride along with the big
// one instead of each paying a launch and a tail. Member g owns blocks first_block ..
// (next member's first_block - 1) and writes output columns col .. col + n - 1.
struct Member {
  const uint8_t* pairs;
  const uint8_t* scale;
  const float* global_scale;
  const uint16_t* bias;  // or null
  long long stride_p, stride_s;  // bytes from one 16-row tile of the codes to the next; scale rows
  int n, col, first_block;
  int scale_pairs_aligned;  // every row's scales start 2-byte aligned: one load per group pair
};

constexpr int kMaxMembers = 3;
constexpr int kDepth = 2;    // W chunks in flight per warp (in registers)
// x quads in shared memory per block (M > 8): the one being multiplied and the next (more
// slots gained nothing).
constexpr int kXStages = 2;

struct Args {
  const uint16_t* x;
  Member member[kMaxMembers];
  // The LoRA shrink of the members' fp32 adapters A_g [rank, K] (or none: shrink_blocks 0):
  // xa[split][token][g * rank + r] = x[token, the split's K range] . A_g[r, that range].
  const float* lora_a[kMaxMembers];
  float* xa;
  long long stride_xas, stride_xam;
  int rank, shrink_blocks;
  void* out;  // [splits][M][sum of n]: fp32 if out_f32, else x's dtype
  long long stride_xm, stride_os, stride_om;
  int members, m, groups;
  int k_warps;          // warps of a block that split its K range (1, 2 or 4; 1 for M > 8)
  int quads_per_split;  // quads of chunks (4 x 32 weights of K) per split
  int blocks, splits;   // the weights' blocks per split; splits of K
  int out_f32;
  float post;  // 2^62 (bf16) or 2^14 (fp16)
};

// Blocks per SM the registers must allow: the warps in flight are what hides memory
// latency (higher bounds spill registers, or win on some layers and lose on others).
template <int MT>
constexpr int min_blocks() {
  return MT == 1 ? 6 : MT == 2 ? 5 : 4;
}

// Past one 8-token tile, x loaded by every warp through L1 bounds the kernel: a warp's
// 16-byte load of 8 tokens touches 16 cache lines (the four threads of a token read 64 bytes
// apart), and each tile adds another such load per weight fragment. There the block's four
// warps (each its own strip, one K range) share x staged once in shared memory, read back
// conflict-free.
template <int MT>
__host__ __device__ constexpr bool shared_x() {
  return MT > 1;
}

// A shrink block's warp: one row r of A_g over the K range [k_begin, k_end), for every
// token, in fp32 (exact products of x's 16-bit values, fp32 sums in a fixed order). A's row
// streams through 16 bytes a lane (2-4 loads in flight); x, a few KB a token, is read through
// L1 by the block's four warps. Why here and not in a launch of its own: the shrink is a
// small grid that mostly waits on loads; beside the weight's blocks in one launch it needs
// no stream of its own, no event to fork and join it, and no counter to add its K slices
// up (the expand adds them, as it adds the weight's).
template <bool BF16, int MT>
__device__ __forceinline__ void shrink_row(const Args& a, int g, int r, int split, int k_begin,
                                           int k_end, int lane) {
  constexpr int T = MT * 8;
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.f;
  const float* row = a.lora_a[g] + static_cast<long long>(r) * 16 * a.groups;
  constexpr int kAhead = MT > 2 ? 2 : 4;  // 16-byte loads of A in flight a lane (registers)
  for (int k0 = k_begin + 4 * lane; k0 < k_end; k0 += 128 * kAhead) {
    float4 w[kAhead];
#pragma unroll
    for (int i = 0; i < kAhead; ++i)
      if (k0 + 128 * i < k_end)
        asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
            : "=f"(w[i].x), "=f"(w[i].y), "=f"(w[i].z), "=f"(w[i].w)
            : "l"(row + k0 + 128 * i));
#pragma unroll
    for (int i = 0; i < kAhead; ++i) {
      const int k = k0 + 128 * i;
      if (k >= k_end) break;
#pragma unroll
      for (int t = 0; t < T; ++t) {
        // Tokens past m read token m - 1 (their sums are never stored).
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(
            a.x + static_cast<long long>(min(t, a.m - 1)) * a.stride_xm + k));
        acc[t] = fmaf(w[i].x, to_float<BF16>(static_cast<uint16_t>(v.x)), acc[t]);
        acc[t] = fmaf(w[i].y, to_float<BF16>(static_cast<uint16_t>(v.x >> 16)), acc[t]);
        acc[t] = fmaf(w[i].z, to_float<BF16>(static_cast<uint16_t>(v.y)), acc[t]);
        acc[t] = fmaf(w[i].w, to_float<BF16>(static_cast<uint16_t>(v.y >> 16)), acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
  if (lane == 0)
#pragma unroll
    for (int t = 0; t < T; ++t)
      if (t < a.m)
        a.xa[split * a.stride_xas + t * a.stride_xam + g * a.rank + r] = acc[t];
}

// MT: 8-token tiles (M <= 8 * MT).
template <bool BF16, int MT>
__global__ void __launch_bounds__(kWarps * 32, min_blocks<MT>())
    nvfp4_gemv_kernel(const __grid_constant__ Args a) {
  constexpr bool XS = shared_x<MT>();
  __shared__ float partial[XS ? 1 : kWarps][MT * 4][32];
  __shared__ uint4 xs[XS ? kXStages : 1][XS ? MT * 8 * 16 : 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = (a.groups + 1) / 2;
  const int quads = (chunks + 3) / 4;
  // The grid is one-dimensional so that every split's shrink blocks come first and are
  // scheduled before the weights' (a warp a row of A, ceil(rank / 4) blocks a member);
  // then the weights' blocks, split after split.
  const bool shrink = static_cast<int>(blockIdx.x) < a.shrink_blocks * a.splits;
  const int per_split = shrink ? a.shrink_blocks : a.blocks;
  const int linear = shrink ? blockIdx.x : blockIdx.x - a.shrink_blocks * a.splits;
  const int bx = linear % per_split, split = linear / per_split;
  // This block's quads (of the weight, or of A for a shrink block).
  const int b_begin = split * a.quads_per_split;
  const int b_end = min(quads, b_begin + a.quads_per_split);
  if (shrink) {
    const int per_member = (a.rank + kWarps - 1) / kWarps;
    const int r = (bx % per_member) * kWarps + warp;
    if (r < a.rank)
      shrink_row<BF16, MT>(a, bx / per_member, r, split, min(128 * b_begin, 16 * a.groups),
                           min(128 * b_end, 16 * a.groups), lane);
    return;
  }
  const int strips_per_block = kWarps / a.k_warps;
  // This block's member. Args is a __grid_constant__: indexing it at run time reads the
  // parameter bank (a plain parameter would be copied to local memory first).
  const Member& mb = a.member[(a.members > 1 && bx >= a.member[1].first_block) +
                              (a.members > 2 && bx >= a.member[2].first_block)];
  const int strip = (bx - mb.first_block) * strips_per_block + warp / a.k_warps;
  const int kslice = warp % a.k_warps;
  const int rows[2] = {strip * 16 + g, strip * 16 + g + 8};
  const int per_warp = (max(b_end - b_begin, 0) + a.k_warps - 1) / a.k_warps;
  const int q_begin = b_begin + kslice * per_warp;
  const int q_end = min(b_end, q_begin + per_warp);
  // Quads below `full` have all four chunks and both groups of each: the main loop reads
  // them without a bounds check. Rows past n and tokens past m read row n - 1 and token
  // m - 1 there (their sums are never stored), so no load is predicated and no register
  // zeroed.
  const int full = min(q_end, max(q_begin, a.groups / 8));
  const uint8_t* w_row[2];
  const uint8_t* s_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const long long row = min(rows[r], mb.n - 1);
    // Tile row / 16 of the layout, its row % 16: a quad of the strip is 1 KB contiguous.
    w_row[r] = mb.pairs + (row / 16) * mb.stride_p + (row % 16) * 64 + 16 * t;  // + 1024 a quad
    s_row[r] = mb.scale + row * mb.stride_s + 2 * t;   // + 8 a quad
  }
  const uint16_t* x_row[XS ? 1 : MT];
  if constexpr (!XS)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      x_row[mt] = a.x + min(mt * 8 + g, a.m - 1) * a.stride_xm + 32 * t;  // + 128 a quad

  auto load = [&](Stage& st, int q) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      st.w[r] = load_stream(w_row[r] + 1024 * q);
      const uint8_t* s = s_row[r] + 8 * q;
      // Both groups' scales in one load where the row's scales are 2-byte aligned.
      st.s[r] = mb.scale_pairs_aligned ? __ldg(reinterpret_cast<const uint16_t*>(s))
                                       : __ldg(s) | static_cast<uint32_t>(__ldg(s + 1)) << 8;
    }
  };
  // The last quad (K not a multiple of 128): chunks past K and a missing high group load
  // zeros, and x there is not read at all (it may not exist).
  auto load_tail = [&](Stage& st, int q) {
    const bool chunk_ok = 4 * q + t < chunks;
    const bool hi_ok = chunk_ok && 2 * (4 * q + t) + 1 < a.groups;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      st.w[r] = chunk_ok ? load_stream(w_row[r] + 1024 * q) : Vec4{{0, 0, 0, 0}};
      const uint8_t* s = s_row[r] + 8 * q;
      st.s[r] = (chunk_ok ? __ldg(s) : 0u) |
                (hi_ok ? static_cast<uint32_t>(__ldg(s + 1)) << 8 : 0u);
    }
  };
  // Shared x (M > 8): the block's threads copy quad q of x (every token tile's 8 rows,
  // 128 columns; columns past K zero-filled) into its slot; then, before a quad is
  // multiplied, wait for its copy and start the one kXStages - 1 quads ahead (the barrier
  // also tells that every warp is done with the slot being refilled). The copy is unrolled,
  // its addresses set up once: above 8 rows the loop is issue-bound, so every instruction
  // of it counts.
  // Thread i copies piece i % 16 of tokens i / 16 + 8j (j < MT): the same piece and token
  // parity (so the same swizzle) for every j.
  const int piece = threadIdx.x & 15, tok0 = threadIdx.x >> 4;
  const int to0 = tok0 * 16 + swizzle(tok0, piece);
  const uint16_t* x_from[XS ? MT : 1];
  if constexpr (XS)
#pragma unroll
    for (int j = 0; j < MT; ++j)
      x_from[j] = a.x + min(tok0 + 8 * j, a.m - 1) * a.stride_xm + 8 * piece;
  static_assert(kWarps * 32 == 8 * 16, "a pass of the block's threads copies 8 tokens");
  auto stage_x = [&](int q) {
    uint4* slot = xs[q % kXStages];
    const bool ok = 128 * q + 8 * piece < 16 * a.groups;
#pragma unroll
    for (int j = 0; j < MT; ++j)
      copy_async(slot + to0 + 128 * j, x_from[j] + (ok ? 128 * q : 0), ok);
  };
  auto next_x = [&](int q) {
    if constexpr (XS) {
      asm volatile("cp.async.wait_group %0;" ::"n"(kXStages - 2));
      __syncthreads();
      if (q + kXStages - 1 < q_end) stage_x(q + kXStages - 1);
      asm volatile("cp.async.commit_group;");
    }
  };

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[mt][j] = 0.f;

  auto compute = [&](const Stage& st, int q, bool tail) {
    const bool chunk_ok = !tail || 4 * q + t < chunks;
    const bool hi_ok = !tail || (chunk_ok && 2 * (4 * q + t) + 1 < a.groups);
    uint32_t s_lo[2], s_hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) scale_pairs<BF16>(st.s[r], s_lo[r], s_hi[r]);
    // Activations x[token, 32p .. 32p + 31] in two halves (fewer live registers): half e
    // holds pairs 4e..4e+3 (under the low nibbles of words 2e, 2e + 1) and 8 + 4e..
    // 8 + 4e + 3 (under the high nibbles).
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      Vec4 xv[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (XS) {
          // Pieces 4t + e and 4t + e + 2 of the quad (zeros past K, copied so).
          const uint4* row = xs[q % kXStages] + (mt * 8 + g) * 16;
          const uint4 lo = row[swizzle(g, 4 * t + e)], hi = row[swizzle(g, 4 * t + e + 2)];
          xv[mt][0] = Vec4{{lo.x, lo.y, lo.z, lo.w}};
          xv[mt][1] = Vec4{{hi.x, hi.y, hi.z, hi.w}};
        } else {
          const uint16_t* xp = x_row[mt] + 128 * q + 8 * e;
          xv[mt][0] = chunk_ok ? load_cached(xp) : Vec4{{0, 0, 0, 0}};
          xv[mt][1] = hi_ok ? load_cached(xp + 16) : Vec4{{0, 0, 0, 0}};
        }
      }
#pragma unroll
      for (int w = 2 * e; w < 2 * e + 2; ++w) {
        uint32_t d0[4], d1[4];
        decode_word<BF16>(st.w[0].v[w], d0);
        decode_word<BF16>(st.w[1].v[w], d1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t frag[4] = {mul2<BF16>(d0[h], s_lo[0]), mul2<BF16>(d1[h], s_lo[1]),
                                    mul2<BF16>(d0[2 + h], s_hi[0]),
                                    mul2<BF16>(d1[2 + h], s_hi[1])};
          const int pair = 2 * (w - 2 * e) + h;  // x pair under the low nibbles
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            mma<BF16>(acc[mt], frag, xv[mt][0].v[pair], xv[mt][1].v[pair]);
        }
      }
    }
  };

  if constexpr (XS) {
#pragma unroll
    for (int i = 0; i < kXStages - 1; ++i) {
      if (q_begin + i < q_end) stage_x(q_begin + i);
      asm volatile("cp.async.commit_group;");
    }
  }
  Stage st[kDepth];
#pragma unroll
  for (int i = 0; i < kDepth; ++i)
    if (q_begin + i < full) load(st[i], q_begin + i);
  for (int q0 = q_begin; q0 < full; q0 += kDepth) {
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      const int q = q0 + i;
      if (q < full) {
        next_x(q);
        compute(st[i], q, false);
        if (q + kDepth < full) load(st[i], q + kDepth);
      }
    }
  }
  for (int q = full; q < q_end; ++q) {
    load_tail(st[0], q);
    next_x(q);
    compute(st[0], q, true);
  }

  // Warps that split K add up in a fixed order (so results are deterministic).
  if constexpr (!XS) {
    if (a.k_warps > 1) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) partial[warp][mt * 4 + j][lane] = acc[mt][j];
      __syncthreads();
      if (kslice != 0) return;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float sum = 0.f;
          for (int k = 0; k < a.k_warps; ++k) sum += partial[warp + k][mt * 4 + j][lane];
          acc[mt][j] = sum;
        }
    }
  }

  const float factor = a.post / *mb.global_scale;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // mma's C fragment: rows g (j < 2) and g + 8, tokens 2t and 2t + 1.
      const int row = rows[j >> 1], tok = mt * 8 + 2 * t + (j & 1);
      if (row >= mb.n || tok >= a.m) continue;
      float v = acc[mt][j] * factor;
      if (mb.bias != nullptr && split == 0) v += to_float<BF16>(mb.bias[row]);
      const long long at = split * a.stride_os + tok * a.stride_om + mb.col + row;
      if (a.out_f32)
        static_cast<float*>(a.out)[at] = v;
      else
        static_cast<uint16_t*>(a.out)[at] = from_float<BF16>(v);
    }
}

template <bool BF16>
cudaError_t launch_dtype(const Args& a, dim3 grid, cudaStream_t stream) {
  switch ((a.m + 7) / 8) {
    case 1: nvfp4_gemv_kernel<BF16, 1><<<grid, kWarps * 32, 0, stream>>>(a); break;
    case 2: nvfp4_gemv_kernel<BF16, 2><<<grid, kWarps * 32, 0, stream>>>(a); break;
    case 3: nvfp4_gemv_kernel<BF16, 3><<<grid, kWarps * 32, 0, stream>>>(a); break;
    case 4: nvfp4_gemv_kernel<BF16, 4><<<grid, kWarps * 32, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <bool BF16>
void load_all(cudaFuncAttributes* attr) {
  cudaFuncGetAttributes(attr, nvfp4_gemv_kernel<BF16, 1>);
  cudaFuncGetAttributes(attr, nvfp4_gemv_kernel<BF16, 2>);
  cudaFuncGetAttributes(attr, nvfp4_gemv_kernel<BF16, 3>);
  cudaFuncGetAttributes(attr, nvfp4_gemv_kernel<BF16, 4>);
}

// Returns a cudaError_t (0: launched). Shapes and strides are checked by the caller
// (nvfp4_gemv.py).
// Member g's fields are element g of the arrays (``members`` of them, all of K columns).
// With lora_a (one fp32 [rank, K] per member, else null) the launch also writes the LoRA
// shrink's split-K partial sums into xa [splits][m][members * rank].
int launch_gemv(int bf16, const void* x, long long stride_xm, int members,
                const void* const* pairs, const long long* stride_p,
                const void* const* scale, const long long* stride_s,
                const void* const* global_scale, const void* const* bias, const int* n,
                void* out, int out_f32, long long stride_os, long long stride_om, int m,
                int k, int splits, int k_warps, const void* const* lora_a, int rank,
                void* xa, long long stride_xas, long long stride_xam, int device,
                void* stream) {
  if (m < 1 || m > 32 || k % 16 != 0 || splits < 1 || members < 1 ||
      members > kMaxMembers || (k_warps != 1 && k_warps != 2 && k_warps != 4) ||
      (m > 8 && k_warps != 1) ||  // shared x: the block's warps share one K range
      (lora_a != nullptr && (rank < 1 || xa == nullptr)))
    return cudaErrorInvalidValue;
  const int groups = k / 16;
  const int quads = ((groups + 1) / 2 + 3) / 4;
  const int strips_per_block = kWarps / k_warps;
  Args a{};
  a.x = static_cast<const uint16_t*>(x);
  int blocks = 0, col = 0;
  for (int g = 0; g < members; ++g) {
    a.member[g] = Member{static_cast<const uint8_t*>(pairs[g]),
                         static_cast<const uint8_t*>(scale[g]),
                         static_cast<const float*>(global_scale[g]),
                         static_cast<const uint16_t*>(bias[g]), stride_p[g], stride_s[g],
                         n[g], col, blocks,
                         reinterpret_cast<uintptr_t>(scale[g]) % 2 == 0 && stride_s[g] % 2 == 0};
    blocks += ((n[g] + 15) / 16 + strips_per_block - 1) / strips_per_block;
    col += n[g];
  }
  a.out = out;
  a.stride_xm = stride_xm;
  a.stride_os = stride_os;
  a.stride_om = stride_om;
  a.members = members;
  a.m = m;
  a.groups = groups;
  a.k_warps = k_warps;
  a.quads_per_split = (quads + splits - 1) / splits;
  a.out_f32 = out_f32;
  a.post = bf16 ? 4611686018427387904.0f : 16384.0f;  // 2^62, 2^14
  if (lora_a != nullptr) {
    for (int g = 0; g < members; ++g) a.lora_a[g] = static_cast<const float*>(lora_a[g]);
    a.xa = static_cast<float*>(xa);
    a.stride_xas = stride_xas;
    a.stride_xam = stride_xam;
    a.rank = rank;
    a.shrink_blocks = members * ((rank + kWarps - 1) / kWarps);
  }
  a.blocks = blocks;
  a.splits = splits;
  const dim3 grid((a.shrink_blocks + blocks) * splits);
  const auto s = static_cast<cudaStream_t>(stream);
  const DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  return bf16 ? launch_dtype<true>(a, grid, s) : launch_dtype<false>(a, grid, s);
}

}  // namespace

extern "C" {

// Loads every kernel on ``device`` now: a first launch inside a CUDA-graph capture must not
// be the one that loads the module (this library has its own CUDA runtime).
int qerl_nvfp4_gemv_init(int device) {
  const DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaFuncAttributes attr;
  load_all<true>(&attr);
  load_all<false>(&attr);
  return cudaGetLastError();
}

const char* qerl_nvfp4_gemv_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // extern "C"

namespace {

// qerl::nvfp4_gemv (its schema and fake implementation are in nvfp4_gemv.py): out [splits,
// m, sum of the members' rows], fp32 partial sums where splits > 1, else the result in x's
// dtype; xa [splits, m, members * rank], the LoRA shrink's fp32 partial sums (no columns
// without adapters).
std::tuple<at::Tensor, at::Tensor> nvfp4_gemv_op(
    const at::Tensor& x, at::TensorList pairs, at::TensorList scale,
    at::TensorList global_scale, const c10::List<std::optional<at::Tensor>>& bias,
    int64_t splits, int64_t k_warps, at::TensorList lora_a) {
  const qerl::Weights w("qerl::nvfp4_gemv", pairs, scale, global_scale, bias);
  TORCH_CHECK(lora_a.empty() || static_cast<int>(lora_a.size()) == w.count(),
              "qerl::nvfp4_gemv takes one adapter per weight or none");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "qerl::nvfp4_gemv needs x 16-byte aligned");
  for (const void* codes : w.pairs) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(codes) % 16 == 0,
                "qerl::nvfp4_gemv needs the packed weights 16-byte aligned");
  }
  const int64_t m = x.size(0), rank = lora_a.empty() ? 0 : lora_a[0].size(0);
  at::Tensor out = at::empty({splits, m, w.width},
                             x.options().dtype(splits > 1 ? at::kFloat : x.scalar_type()));
  at::Tensor xa = at::empty({splits, m, static_cast<int64_t>(lora_a.size()) * rank},
                            x.options().dtype(at::kFloat));
  const auto a = qerl::pointers(lora_a);
  qerl::check_launch(
      launch_gemv(x.scalar_type() == at::kBFloat16, x.data_ptr(), x.stride(0), w.count(),
                  w.pairs.data(), w.stride_p.data(), w.scale.data(), w.stride_s.data(),
                  w.global_scale.data(), w.bias.data(), w.rows.data(), out.data_ptr(),
                  splits > 1, out.stride(0), out.stride(1), static_cast<int>(m),
                  static_cast<int>(x.size(1)), static_cast<int>(splits),
                  static_cast<int>(k_warps), lora_a.empty() ? nullptr : a.data(),
                  static_cast<int>(rank), lora_a.empty() ? nullptr : xa.data_ptr(),
                  xa.stride(0), xa.stride(1), x.get_device(), qerl::stream_of(x)),
      "the CUDA NVFP4 kernel");
  return {out, xa};
}

}  // namespace

TORCH_LIBRARY_IMPL(qerl, CUDA, m) { m.impl("nvfp4_gemv", &nvfp4_gemv_op); }
