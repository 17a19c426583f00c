// NVFP4 x BF16/FP16 GEMM on Hopper tensor cores (wgmma), for the rows the CUDA small-M
// kernel (nvfp4_gemv.cu) leaves: out[M][N] = x[M, K] @ deq(W[N, K])^T (+ bias), M from 33
// rows (a rollout's decode step) to tens of thousands (training). Built and loaded by
// nvfp4_gemm.py; sm_90a only (wgmma is an architecture-specific feature).
//
// Shape of the computation: D[64 W rows x BM tokens] += A[64 x 16] B[16 x BM] per wgmma, A
// the decoded weight in registers, B x^T in shared memory. So each weight is decoded once
// per BM tokens, in registers (the 8-instruction word decode of nvfp4_decode.cuh and one
// packed multiply by its group scale, exact), and never written back as 16-bit values: the
// weight stream stays 0.5625 bytes a weight from HBM to the tensor core. The A fragment of a
// warp is mma.m16n8k16's, so the register layout the small-M kernel uses carries over: thread
// (g, t) of warp w owns rows 16w + g and 16w + g + 8 of its warpgroup's 64 and, in a quad of
// four 32-weight chunks (128 of K), chunk t. Its k values are not the 16 consecutive ones
// wgmma's A fragment names, so x is stored in that order instead: nvfp4_layout.gemm_tiles
// permutes x's columns within each 128 and lays each 128 out as two tiles of BM tokens x 64
// columns, already in wgmma's swizzled layout (one copy of x, ~1% of the weight's bytes at
// the sizes where this kernel runs), so that B's 16-column k steps read it as they come and
// a unit's x is two contiguous bulk copies.
//
// A block (one an SM): two consumer warpgroups (128 W rows) x BM tokens (64-256) and a
// producer warp, a pipeline of 128-column quads on mbarriers (the W tiles of 16 rows x 1 KB
// and x's two halves as bulk copies, their 128 x 8 scale bytes as cp.async), each quad eight
// wgmmas of K = 16 per warpgroup. The consumers only decode and multiply: no copy, no block
// barrier in their loop. The work is split stream-K: a (tile, quad) pair is a
// unit, and the grid's blocks (as many as fit on the GPU at once) each take an equal run of
// units in tile order, so no wave is short and one pipeline runs through a block's tiles.
// A tile shared by several blocks is finished by those whose runs end in it, each adding
// a slice of the fp32 partials in block order: the sum's order is fixed by the launch
// shape, and results repeat bit for bit.

#include "nvfp4_decode.cuh"
#include "torch_op.cuh"

namespace {

using namespace qerl;

// wgmma m64nBMk16 with A in registers (four 16-bit pairs a thread) and B from shared memory
// (descriptor b): d += A B, fp32 accumulators (BM / 2 a thread).
template <int BM>
struct Wgmma;

// The instruction of one dtype (the two differ only in that word); per BM, its
// placeholders (accumulators, A, B) and its accumulator operands (each BM's those of the
// BM - 64 before it and 32 more).
#define QERL_WGMMA(N, T) "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " "
#define QERL_WGMMA_A "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)

#define QERL_WGMMA_P64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
#define QERL_WGMMA_D64 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

#define QERL_WGMMA_P128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
#define QERL_WGMMA_D128 \
    QERL_WGMMA_D64, \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define QERL_WGMMA_P192 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, 1, 1, 1, 0;"
#define QERL_WGMMA_D192 \
    QERL_WGMMA_D128, \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])

#define QERL_WGMMA_P256 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;"
#define QERL_WGMMA_D256 \
    QERL_WGMMA_D192, \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// wgmma m64nNk16 with its N / 2 accumulators a thread.
#define QERL_WGMMA_SHAPE(N)                                                                \
  template <>                                                                              \
  struct Wgmma<N> {                                                                        \
    template <bool BF16>                                                                   \
    static __device__ __forceinline__ void run(float (&d)[N / 2], const uint32_t (&a)[4],  \
                                               uint64_t b) {                               \
      if constexpr (BF16)                                                                  \
        asm volatile(QERL_WGMMA(N, "bf16") QERL_WGMMA_P##N : QERL_WGMMA_D##N : QERL_WGMMA_A); \
      else                                                                                 \
        asm volatile(QERL_WGMMA(N, "f16") QERL_WGMMA_P##N : QERL_WGMMA_D##N : QERL_WGMMA_A); \
    }                                                                                      \
  };

QERL_WGMMA_SHAPE(64)
QERL_WGMMA_SHAPE(128)
QERL_WGMMA_SHAPE(192)
QERL_WGMMA_SHAPE(256)

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void copy_async8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_address(smem)), "l"(gmem));
}

// The pipeline's barriers (mbarrier): a stage is full once its bulk copies' bytes and the
// producer lanes' scale copies are in; empty once every consumer warp is done with it.
__device__ __forceinline__ void barrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)),
               "r"(arrivals));
}

__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

__device__ __forceinline__ void barrier_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   smem_address(bar)), "r"(bytes) : "memory");
}

// Arrives on bar once this thread's cp.async copies so far have landed.
__device__ __forceinline__ void barrier_arrive_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(bar))
               : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}" ::"r"(smem_address(bar)), "r"(parity) : "memory");
}

// A bulk copy (the copy engine, no thread's registers) of `bytes` (a multiple of 16) that
// counts its bytes on bar.
__device__ __forceinline__ void copy_bulk(void* smem, const void* gmem, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_address(smem)), "l"(gmem), "r"(bytes), "r"(smem_address(bar)) : "memory");
}

constexpr int kThreads = 256;  // two consumer warpgroups
// A third warpgroup, the producer: its first warp issues the copies. Registers go to
// warps 4 at a time, so one producer warp would cost a warpgroup's anyway; setmaxnreg
// moves the producer's to the consumers (their fragments, accumulators and decode).
constexpr int kProducer = kThreads / 32;
constexpr int kBlockThreads = kThreads + 128;
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(kThreads * kConsumerRegisters + 128 * kProducerRegisters <= 65536);

// The consumers' barrier (the producer warp has its own loop and leaves early).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
}

constexpr int kRows = 128;  // W rows a block: 64 a warpgroup

// A stage of the pipeline in shared memory: the codes of 8 strips (16 rows x 1 KB), the
// rows' 8 scale bytes of the quad, then x (BM tokens x 128 columns, wgmma's layout).
constexpr int kScalesAt = kRows * 64;
constexpr int kXAt = kRows * 72;  // a multiple of 1024: the swizzled x starts aligned

template <int BM>
__host__ __device__ constexpr int stage_bytes() {
  return kXAt + BM * 256;
}

// Pipeline stages: as many as fit in shared memory (227 KB a block) beside the barriers,
// but 6 at 64 tokens, where 8 ran the large layers slower, and 5 at 128, which beat 4 (a
// development sweep on an H200; kernels/DESIGN.md).
template <int BM>
__host__ __device__ constexpr int stages() {
  return BM == 64 ? 6 : BM == 128 ? 5 : 3;
}

// The stages (from a 1024-byte boundary: the swizzle's pattern repeats every 1024 bytes of
// address), then a full and an empty barrier a stage.
template <int BM>
__host__ __device__ constexpr int smem_bytes() {
  return stages<BM>() * stage_bytes<BM>() + 1024 + 16 * stages<BM>();
}

// B's descriptor: K-major with the 128-byte swizzle, each 64 columns of the quad a block of
// BM token rows of 128 bytes, 8-row groups 1024 bytes apart (stride byte offset; the
// leading one is unused), a k step 32 bytes into the row.
__device__ __forceinline__ uint64_t x_descriptor(uint32_t at) {
  return ((at & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

constexpr int kMembers = 3;  // weights multiplied side by side (q/k/v, gate/up)

// One weight of the launch: its rows are output columns begin .. begin + n - 1.
struct Member {
  const uint8_t* pairs;
  const uint8_t* scale;
  const float* global_scale;
  const uint16_t* bias;  // or null
  long long stride_p, stride_s;
  int begin, n;
};

struct GemmArgs {
  const uint16_t* x;  // gemm_tiles: [quads][2][tiles_m * BM][64], swizzled, zeros past M, K
  Member w[kMembers];  // every member but the last a whole number of tiles wide
  int members;
  uint16_t* out;   // [m][n], x's dtype: the members' outputs side by side
  float* partial;  // [blocks][2][BM / 2][kThreads]: a block's first and last piece
  int* ready;      // [blocks][2], zeros: set once that partial is written
  long long stride_om;
  long long units;  // tiles * quads, tiles = tiles_m * ceil(n / kRows), m fastest
  int m, n, quads, tiles_m, blocks;
  float post;  // 2^62 (bf16) or 2^14 (fp16)
};

// The member whose rows the output columns from n0 are (a tile is in one member).
__device__ __forceinline__ const Member& member_at(const GemmArgs& a, int n0) {
  return n0 >= a.w[2].begin && a.members > 2   ? a.w[2]
         : n0 >= a.w[1].begin && a.members > 1 ? a.w[1]
                                               : a.w[0];
}

// The first (tile, quad) unit of block b: each block multiplies an equal run of the units
// (stream-K), so every SM has the same work and no wave is short.
__device__ __forceinline__ long long first_unit(const GemmArgs& a, int b) {
  return a.units * b / a.blocks;
}

// The block's output tile (columns n0 .. of the output, rows of member w), scaled and its
// bias added, through shared memory: D's fragment
// (per 8 tokens j: rows g and g + 8 of the warp's strip, tokens 2t, 2t + 1) lands as
// [token][row], padded 16 bytes a token against bank conflicts, and goes out as 16-byte
// rows of out[token][n0 ..] instead of 2-byte scattered stores.
template <bool BF16, int BM>
__device__ __forceinline__ void write_tile(const GemmArgs& a, const Member& w,
                                           const float (&acc)[BM / 2], uint8_t* smem, int m0,
                                           int n0) {
  constexpr int kEl = 8, kPitch = kRows + kEl, kPieces = kRows / kEl;
  static_assert(BM * kPitch * 2 <= stage_bytes<BM>(), "the tile fits a stage");
  uint16_t* tile = reinterpret_cast<uint16_t*>(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const float factor = a.post / *w.global_scale;
  const int end = w.begin + w.n;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = warp * 16 + g + 8 * (e >> 1), tok = 8 * j + 2 * t + (e & 1);
      float v = acc[4 * j + e] * factor;
      if (w.bias != nullptr && n0 + row < end) v += to_float<BF16>(w.bias[n0 + row - w.begin]);
      tile[tok * kPitch + row] = from_float<BF16>(v);
    }
  consumers_sync();
  const bool vectors =
      reinterpret_cast<uintptr_t>(a.out) % 16 == 0 && a.stride_om % kEl == 0;
  for (int i = threadIdx.x; i < BM * kPieces; i += kThreads) {
    const int tok = i / kPieces, col = (i % kPieces) * kEl;
    if (m0 + tok >= a.m || n0 + col >= a.n) continue;
    const uint16_t* from = tile + tok * kPitch + col;
    uint16_t* to = a.out + (m0 + tok) * a.stride_om + n0 + col;
    if (vectors && n0 + col + kEl <= a.n) {
      *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
    } else {
      for (int c = 0; c < kEl && n0 + col + c < a.n; ++c) to[c] = from[c];
    }
  }
}

__device__ __forceinline__ void release(int* flag) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
}

__device__ __forceinline__ void acquire(const int* flag) {
  int v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    if (v) return;
    __nanosleep(256);
  }
}

// The block holding unit u (the inverse of first_unit).
__device__ __forceinline__ int block_of(const GemmArgs& a, long long u) {
  return static_cast<int>(((u + 1) * a.blocks - 1) / a.units);
}

// Block b's partial slot: 0 for its first piece, 1 for its last when that is another.
template <int BM>
__device__ __forceinline__ float* partial_at(const GemmArgs& a, int b, int slot) {
  return a.partial + (2ll * b + slot) * (BM / 2) * kThreads;
}

// Accumulators j0 .. j1 - 1 of a tile (output columns n0 .., tokens m0 ..) summed over the
// partials of blocks lo .. hi in block order, scaled, biased and written. W accumulators
// of U blocks at a time are loaded before any is added, so the partials come in one round
// trip per W x U, not one per block.
template <bool BF16, int BM, int W, int U>
__device__ __forceinline__ void sum_slice(const GemmArgs& a, const Member& w, int lo, int hi,
                                          int lo_slot, int j0, int j1, int m0, int n0) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int n_end = w.begin + w.n;
  const float factor = a.post / *w.global_scale;
  for (int jw = j0; jw < j1; jw += W) {
    float v[W];
#pragma unroll
    for (int i = 0; i < W; ++i) v[i] = 0.f;
    for (int b0 = lo; b0 <= hi; b0 += U) {
      float x[U][W];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float* from = partial_at<BM>(a, b0 + u, b0 + u == lo ? lo_slot : 0) + tid;
#pragma unroll
        for (int i = 0; i < W; ++i)
          x[u][i] = b0 + u <= hi && jw + i < j1 ? __ldcg(from + (jw + i) * kThreads) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int i = 0; i < W; ++i)
          if (b0 + u <= hi) v[i] += x[u][i];
    }
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const int j = jw + i;
      // D's fragment: rows g and g + 8 of the warp's strip, tokens 2t, 2t + 1 of each 8.
      const int row = warp * 16 + g + 8 * ((j & 3) >> 1), tok = 8 * (j >> 2) + 2 * t + (j & 1);
      if (j >= j1 || m0 + tok >= a.m || n0 + row >= a.n) continue;
      float y = v[i] * factor;
      if (w.bias != nullptr && n0 + row < n_end) y += to_float<BF16>(w.bias[n0 + row - w.begin]);
      a.out[(m0 + tok) * a.stride_om + n0 + row] = from_float<BF16>(y);
    }
  }
}

// The blocks sharing a tile: lo .. hi, lo's piece in its partial slot lo_slot (its last
// piece, 1, unless the tile starts its run), and how many of them finish the tile when it
// is split: those whose last piece is in it (all but hi, if hi goes on to other tiles).
struct Sharing {
  int lo, hi, lo_slot, finishers;
};

__device__ __forceinline__ Sharing sharing(const GemmArgs& a, long long tile) {
  const long long start = tile * a.quads, end = start + a.quads;
  const int lo = block_of(a, start), hi = block_of(a, end - 1);
  return {lo, hi, first_unit(a, lo) < start, hi - lo + (first_unit(a, hi + 1) <= end)};
}

// A tile of this many pieces or more is finished by every block whose run ends in it, each
// summing a slice (finish_last); one of fewer by the block holding its start alone, which
// adds the others' partials to its own sums. Measured (dev sweeps, H100, 64-256 rows): the
// split wins where a tile has many pieces (the deep layers, down, at 64 rows) and loses
// where it has few (its slices go out as scattered stores, a window of loads at a time).
constexpr int kSplitFrom = 7;

// A block's piece of a tile (quads q_first .. q_last of it) is done, its sums in acc. A
// whole tile goes out at once; a piece of a shared one as fp32 partial sums with a released
// flag (slot: the block's first piece 0, its last 1).
template <bool BF16, int BM>
__device__ __forceinline__ void finish_piece(const GemmArgs& a, const float (&acc)[BM / 2],
                                             uint8_t* smem, long long tile, int q_first,
                                             int q_last, int slot) {
  const int tid = threadIdx.x;
  if (q_first == 0 && q_last == a.quads - 1) {
    consumers_sync();  // both warpgroups are done with the stage the tile goes through
    const int nb = static_cast<int>(tile / a.tiles_m), mb = static_cast<int>(tile % a.tiles_m);
    write_tile<BF16, BM>(a, member_at(a, nb * kRows), acc, smem, mb * BM, nb * kRows);
    return;
  }
  float* to = partial_at<BM>(a, blockIdx.x, slot) + tid;
#pragma unroll
  for (int j = 0; j < BM / 2; ++j) __stcg(to + j * kThreads, acc[j]);
  consumers_sync();
  if (tid == 0) {
    __threadfence();
    release(a.ready + 2 * blockIdx.x + slot);
  }
}

// The block's last piece (after the main loop, whose registers are free then). A piece of
// a tile with fewer than kSplitFrom pieces that starts it: the block finishes the tile
// alone once the others' flags are acquired (all at once), adding their partials to its own
// sums in block order. A split tile's piece goes out as a partial, and the blocks whose
// runs end in the tile finish it together once every piece is in: each adds the partials
// of a slice of the tile's accumulators in block order and writes that slice. The pieces
// end at about the same time, at the end of their blocks' runs, so this is the launch's
// tail; split, it takes a round trip or two instead of one round of loads per piece.
// Either way the sum's order is fixed by the launch shape.
template <bool BF16, int BM>
__device__ __forceinline__ void finish_last(const GemmArgs& a, float (&acc)[BM / 2],
                                            uint8_t* smem, long long tile, int q_first,
                                            int q_last, bool first) {
  if (q_first == 0 && q_last == a.quads - 1) {
    finish_piece<BF16, BM>(a, acc, smem, tile, q_first, q_last, 0);
    return;
  }
  const Sharing s = sharing(a, tile);
  const bool split = s.hi - s.lo + 1 >= kSplitFrom;
  if (split || blockIdx.x != s.lo) {
    finish_piece<BF16, BM>(a, acc, smem, tile, q_first, q_last, !first);
    if (!split) return;
  }
  for (int b = s.lo + threadIdx.x; b <= s.hi; b += kThreads)
    if (b != blockIdx.x) acquire(a.ready + 2 * b + (b == s.lo ? s.lo_slot : 0));
  consumers_sync();
  const int nb = static_cast<int>(tile / a.tiles_m), mb = static_cast<int>(tile % a.tiles_m);
  const Member& w = member_at(a, nb * kRows);
  if (!split) {  // this block is lo: the others' pieces start their runs (slot 0)
    for (int b = s.lo + 1; b <= s.hi; ++b) {
      const float* from = partial_at<BM>(a, b, 0) + threadIdx.x;
#pragma unroll
      for (int j = 0; j < BM / 2; ++j) acc[j] += __ldcg(from + j * kThreads);
    }
    write_tile<BF16, BM>(a, w, acc, smem, mb * BM, nb * kRows);
    return;
  }
  const int p = blockIdx.x - s.lo, j0 = BM / 2 * p / s.finishers,
            j1 = BM / 2 * (p + 1) / s.finishers;
  if (s.hi - s.lo < 4)
    sum_slice<BF16, BM, 8, 4>(a, w, s.lo, s.hi, s.lo_slot, j0, j1, mb * BM, nb * kRows);
  else
    sum_slice<BF16, BM, 4, 8>(a, w, s.lo, s.hi, s.lo_slot, j0, j1, mb * BM, nb * kRows);
}

template <bool BF16, int BM>
__global__ void __launch_bounds__(kBlockThreads, 1)
    nvfp4_gemm_kernel(const __grid_constant__ GemmArgs a) {
  constexpr int S = stages<BM>(), STAGE = stage_bytes<BM>();
  constexpr uint32_t kStageBytes = kRows * 64 + BM * 256;  // the bulk copies' (codes, x)
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - smem_address(smem_raw)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * STAGE);
  uint64_t* empty = full + S;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const long long begin = first_unit(a, blockIdx.x);
  const int count = static_cast<int>(first_unit(a, blockIdx.x + 1) - begin);
  if (count <= 0) return;  // (the host launches at most one block a unit)
  if (tid == 0) {
    for (int i = 0; i < S; ++i) {
      barrier_init(full + i, 33);  // the copies' bytes + 32 producer lanes' scale copies
      barrier_init(empty + i, kThreads / 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp >= kProducer) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegisters));
    if (warp != kProducer) return;
    // Unit i's copies into stage i % S once the consumers are done with unit i - S, a
    // lane each, side by side (one warp issuing them one after another was the kernel's
    // bottleneck at 64 tokens): lanes 0-7 a strip's 1 KB of codes and lanes 8-9 a half of
    // x (BM tokens x 128 bytes, already in the swizzled layout: gemm_tiles) as bulk
    // copies, and every lane 4 of the 128 rows' 8 scale bytes. The sources are aimed at a
    // tile once and step a quad a copy; rows past N copy the last strip and row again:
    // their sums land in rows that are never stored.
    const long long x_quad = 2ll * a.tiles_m * BM * 64;  // x's elements a quad
    const uint8_t* from = nullptr;  // this lane's bulk copy
    const uint8_t* scale_from[kRows / 32];
    uint32_t bytes = 0, to = 0;
    long long tile = begin / a.quads;
    int q = static_cast<int>(begin % a.quads);
    auto aim = [&]() {
      const int nb = static_cast<int>(tile / a.tiles_m);
      const int mb = static_cast<int>(tile - static_cast<long long>(nb) * a.tiles_m);
      const Member& w = member_at(a, nb * kRows);
      const int row0 = nb * kRows - w.begin;
      if (lane < kRows / 16) {
        from = w.pairs + min(row0 / 16 + lane, (w.n - 1) / 16) * w.stride_p + 1024ll * q;
        bytes = 1024;
        to = lane * 1024;
      } else if (lane < kRows / 16 + 2) {
        const int h = lane - kRows / 16;
        from = reinterpret_cast<const uint8_t*>(
            a.x + q * x_quad + (h * a.tiles_m + mb) * static_cast<long long>(BM) * 64);
        bytes = BM * 128;
        to = kXAt + h * BM * 128;
      }
#pragma unroll
      for (int r = 0; r < kRows / 32; ++r)
        scale_from[r] = w.scale + min(row0 + lane + 32 * r, w.n - 1) * w.stride_s + 8ll * q;
    };
    aim();
    for (int i = 0; i < count; ++i) {
      const int slot = i % S;
      if (i >= S) barrier_wait(empty + slot, ((i / S) + 1) & 1);
      uint8_t* s = smem + slot * STAGE;
      if (lane == 0) barrier_expect(full + slot, kStageBytes);
      __syncwarp();
      if (bytes) copy_bulk(s + to, from, bytes, full + slot);
#pragma unroll
      for (int r = 0; r < kRows / 32; ++r)
        copy_async8(s + kScalesAt + (lane + 32 * r) * 8, scale_from[r]);
      barrier_arrive_copies(full + slot);
      if (++q == a.quads) {
        q = 0;
        ++tile;
        aim();
      } else {
        if (bytes) from += lane < kRows / 16 ? 1024 : x_quad * 2;  // (lanes past 9 copy none)
#pragma unroll
        for (int r = 0; r < kRows / 32; ++r) scale_from[r] += 8;
      }
    }
    // Stay until the last copies are in (the consumers wait for them).
    for (int i = max(0, count - S); i < count; ++i) barrier_wait(full + i % S, (i / S) & 1);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegisters));

  float acc[BM / 2];
#pragma unroll
  for (int j = 0; j < BM / 2; ++j) acc[j] = 0.f;
  // Warp w multiplies strip w of the block (rows 16w .. 16w + 15): warpgroup w / 4 holds
  // rows 64 (w / 4) .. + 63 of the block, the wgmma's 64.
  const int code_at = warp * 1024 + g * 64 + t * 16;
  const int scale_at = kScalesAt + (warp * 16 + g) * 8 + 2 * t;
  const uint32_t x_base = smem_address(smem + kXAt);

  // Unit i's weight fragments from its stage, once its copies are in: step 2 wd + h
  // multiplies pair h of word wd's low group (k slots 2t, 2t + 1) and of its high group
  // (slots 2t + 8, 2t + 9), rows g and g + 8: gemm_order's columns.
  auto decode = [&](uint32_t (&frag)[8][4], int i) {
    barrier_wait(full + i % S, (i / S) & 1);
    const uint8_t* s = smem + (i % S) * STAGE;
    uint32_t s_lo[2], s_hi[2];
    Vec4 w[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint4 v = *reinterpret_cast<const uint4*>(s + code_at + r * 512);
      w[r] = Vec4{{v.x, v.y, v.z, v.w}};
      scale_pairs<BF16>(*reinterpret_cast<const uint16_t*>(s + scale_at + r * 64), s_lo[r],
                        s_hi[r]);
    }
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      uint32_t d0[4], d1[4];
      decode_word<BF16>(w[0].v[wd], d0);
      decode_word<BF16>(w[1].v[wd], d1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        frag[2 * wd + h][0] = mul2<BF16>(d0[h], s_lo[0]);
        frag[2 * wd + h][1] = mul2<BF16>(d1[h], s_lo[1]);
        frag[2 * wd + h][2] = mul2<BF16>(d0[2 + h], s_hi[0]);
        frag[2 * wd + h][3] = mul2<BF16>(d1[2 + h], s_hi[1]);
      }
    }
  };
  // Unit i: its eight wgmmas go out; while they run, the unit before is waited for and its
  // stage handed back to the producer, and the next unit decoded into the other fragment
  // registers (the decode overlaps the tensor core). A piece's last stage is handed back
  // only after the piece has gone out through it (finish_piece).
  auto step = [&](int i, const uint32_t (&frag)[8][4], uint32_t (&next)[8][4]) {
    const uint32_t x_slot = x_base + (i % S) * STAGE;
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 8; ++k)
      Wgmma<BM>::template run<BF16>(
          acc, frag[k], x_descriptor(x_slot + (k >> 2) * BM * 128 + (k & 3) * 32));
    wgmma_commit();
    wgmma_wait<1>();
    if (i > 0) {
      __syncwarp();
      if (lane == 0) barrier_arrive(empty + (i - 1) % S);
    }
    if (i + 1 < count) decode(next, i + 1);
  };
  // A piece's units, two at a time so that the fragments stay in registers: from the
  // fragments `now` (decoded) to the ones its last unit decoded the next piece's first into.
  auto piece = [&](int i, int end, uint32_t (&now)[8][4], uint32_t (&other)[8][4]) {
    for (; i < end; i += 2) {
      step(i, now, other);
      if (i + 1 < end) step(i + 1, other, now);
    }
  };

  uint32_t frag[2][8][4];
  decode(frag[0], 0);
  long long tile = begin / a.quads;
  int q_first = static_cast<int>(begin % a.quads);
  for (int i = 0, odd = 0;; ++tile, q_first = 0) {
    const int end = min(count, i + a.quads - q_first);
    if (odd)
      piece(i, end, frag[1], frag[0]);
    else
      piece(i, end, frag[0], frag[1]);
    odd ^= (end - i) & 1;
    wgmma_wait<0>();
    // Its sums are done; it goes out through its last unit's stage (handed back in the
    // next unit's step). Any piece but the block's last is a whole tile or the end of one
    // that starts elsewhere.
    if (end == count) {
      finish_last<BF16, BM>(a, acc, smem + ((end - 1) % S) * STAGE, tile, q_first,
                            q_first + end - i - 1, i == 0);
      return;
    }
    finish_piece<BF16, BM>(a, acc, smem + ((end - 1) % S) * STAGE, tile, q_first,
                           q_first + end - i - 1, 0);
    // The stage was written through the generic proxy; the producer's next copy into it
    // goes through the async one.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#pragma unroll
    for (int j = 0; j < BM / 2; ++j) acc[j] = 0.f;
    i = end;
  }
}

template <bool BF16, int BM>
cudaError_t launch(const GemmArgs& a, cudaStream_t stream) {
  nvfp4_gemm_kernel<BF16, BM><<<a.blocks, kBlockThreads, smem_bytes<BM>(), stream>>>(a);
  return cudaGetLastError();
}

template <bool BF16, int BM>
cudaError_t prepare_one() {
  return cudaFuncSetAttribute(nvfp4_gemm_kernel<BF16, BM>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<BM>());
}

template <bool BF16>
cudaError_t prepare() {
  cudaError_t e = prepare_one<BF16, 64>();
  if (e == cudaSuccess) e = prepare_one<BF16, 128>();
  if (e == cudaSuccess) e = prepare_one<BF16, 192>();
  if (e == cudaSuccess) e = prepare_one<BF16, 256>();
  return e;
}

template <bool BF16>
cudaError_t launch_bm(const GemmArgs& a, int bm, cudaStream_t stream) {
  switch (bm) {
    case 64: return launch<BF16, 64>(a, stream);
    case 128: return launch<BF16, 128>(a, stream);
    case 192: return launch<BF16, 192>(a, stream);
    default: return launch<BF16, 256>(a, stream);
  }
}

// Returns a cudaError_t (0: launched). x is in gemm order, [m, quads * 128]; member i of
// `members` has pairs[i], scale[i] (row strides stride_p[i], stride_s[i]), global_scale[i],
// bias[i] (or null) and n[i] rows, all but the last a multiple of 128; out is [m, sum n];
// partial holds blocks * bm * 256 floats, ready 2 * blocks ints, zeroed. Shapes and
// strides are checked by the caller.
int launch_gemm(int bf16, const void* x, int members,
                const void* const* pairs, const long long* stride_p,
                const void* const* scale, const long long* stride_s,
                const void* const* global_scale, const void* const* bias, const int* n,
                void* out, long long stride_om, void* partial, void* ready, int m,
                int quads, int bm, int blocks, int device, void* stream) {
  if (m < 1 || quads < 1 || blocks < 1 || (bm % 64 != 0 || bm < 64 || bm > 256) || members < 1 ||
      members > kMembers)
    return cudaErrorInvalidValue;
  GemmArgs a{};
  a.x = static_cast<const uint16_t*>(x);
  a.members = members;
  int total = 0;
  for (int i = 0; i < members; ++i) {
    if (n[i] < 1 || (i + 1 < members && n[i] % kRows != 0)) return cudaErrorInvalidValue;
    a.w[i] = Member{static_cast<const uint8_t*>(pairs[i]), static_cast<const uint8_t*>(scale[i]),
                static_cast<const float*>(global_scale[i]),
                static_cast<const uint16_t*>(bias[i]), stride_p[i], stride_s[i], total, n[i]};
    total += n[i];
  }
  a.out = static_cast<uint16_t*>(out);
  a.partial = static_cast<float*>(partial);
  a.ready = static_cast<int*>(ready);
  a.stride_om = stride_om;
  a.m = m;
  a.n = total;
  a.quads = quads;
  a.tiles_m = (m + bm - 1) / bm;
  a.units = static_cast<long long>(a.tiles_m) * ((total + kRows - 1) / kRows) * quads;
  if (blocks > a.units) return cudaErrorInvalidValue;
  a.blocks = blocks;
  a.post = bf16 ? 4611686018427387904.0f : 16384.0f;  // 2^62, 2^14
  const DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  const auto s = static_cast<cudaStream_t>(stream);
  return bf16 ? launch_bm<true>(a, bm, s) : launch_bm<false>(a, bm, s);
}

}  // namespace

extern "C" {

// Loads the kernels on ``device`` and allows them their shared memory: before any graph
// capture, as the small-M kernel's init.
int qerl_nvfp4_gemm_init(int device) {
  const DeviceGuard guard(device);
  cudaError_t e = guard.error();
  if (e == cudaSuccess) e = prepare<true>();
  if (e == cudaSuccess) e = prepare<false>();
  return e;
}

const char* qerl_nvfp4_gemm_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // extern "C"

namespace {

// qerl::nvfp4_gemm (its schema and fake implementation are in nvfp4_gemm.py): x in gemm
// order [quads, 2, rows, 64] (gemm_tiles), its first m rows the tokens; ready 2 * blocks
// int32 flags, zeroed (gemm_tiles zeroes them on the way), which the launch sets; out [m,
// sum of the members' rows] in x's dtype.
at::Tensor nvfp4_gemm_op(const at::Tensor& x, const at::Tensor& ready, at::TensorList pairs,
                         at::TensorList scale, at::TensorList global_scale,
                         const c10::List<std::optional<at::Tensor>>& bias, int64_t m,
                         int64_t token_tile, int64_t blocks) {
  const qerl::Weights w("qerl::nvfp4_gemm", pairs, scale, global_scale, bias);
  TORCH_CHECK(ready.numel() >= 2 * blocks, "qerl::nvfp4_gemm needs 2 ready flags a block");
  for (int i = 0; i < w.count(); ++i) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(w.pairs[i]) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(w.scale[i]) % 8 == 0,
                "qerl::nvfp4_gemm needs the codes 16-byte and the scale rows 8-byte aligned");
  }
  at::Tensor out = at::empty({m, w.width}, x.options());
  at::Tensor partial =
      at::empty({blocks * token_tile * kThreads}, x.options().dtype(at::kFloat));
  qerl::check_launch(
      launch_gemm(x.scalar_type() == at::kBFloat16, x.data_ptr(), w.count(), w.pairs.data(),
                  w.stride_p.data(), w.scale.data(), w.stride_s.data(),
                  w.global_scale.data(), w.bias.data(), w.rows.data(), out.data_ptr(),
                  out.stride(0), partial.data_ptr(), ready.data_ptr(), static_cast<int>(m),
                  static_cast<int>(x.size(0)), static_cast<int>(token_tile),
                  static_cast<int>(blocks), x.get_device(), qerl::stream_of(x)),
      "the Hopper NVFP4 GEMM");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qerl, CUDA, m) { m.impl("nvfp4_gemm", &nvfp4_gemm_op); }
