// NVFP4 x BF16/FP16 GEMM on Hopper tensor cores (wgmma), for the rows the CUDA small-M
// kernel (nvfp4_gemv.cu) leaves: out[S][M][N] = split-K partial sums of x[M, K] @
// deq(W[N, K])^T, M from 33 rows (a rollout's decode step) to tens of thousands (training).
// Built and loaded by nvfp4_gemm.py; sm_90a only (wgmma is an architecture-specific
// feature).
//
// Shape of the computation: D[64 W rows x BM tokens] += A[64 x 16] B[16 x BM] per wgmma, A
// the decoded weight in registers, B x^T in shared memory. So each weight is decoded once
// per BM tokens, in registers (the 8-instruction word decode of nvfp4_decode.cuh and one
// packed multiply by its group scale, exact), and never written back as 16-bit values: the
// weight stream stays 0.5625 bytes a weight from HBM to the tensor core. The A fragment of a
// warp is mma.m16n8k16's, so the register layout the small-M kernel uses carries over: thread
// (g, t) of warp w owns rows 16w + g and 16w + g + 8 of its warpgroup's 64 and, in a quad of
// four 32-weight chunks (128 of K), chunk t. Its k values are not the 16 consecutive ones
// wgmma's A fragment names, so x is stored in that order instead: nvfp4_layout.gemm_order
// permutes x's columns within each 128 (one torch copy of x, ~1% of the weight's bytes at
// the sizes where this kernel runs), and B's 16-column k steps read it as they come.
//
// A block: two warpgroups (128 W rows) x BM tokens (64, 128 or 256), a multistage cp.async
// pipeline of 128-column quads (the W tiles of 16 rows x 1 KB, their 128 x 8 scale bytes and
// BM x 256 bytes of x), each quad eight wgmmas of K = 16 per warpgroup. x sits in wgmma's
// no-swizzle K-major layout: 8-token x 16-byte core matrices, the two halves of a k step
// 128 bytes apart (LBO), 8-token groups 256 bytes apart (SBO), so every copy is 16 bytes and
// a quarter warp writes one core matrix (conflict-free). Splits of K (fp32 partials) fill
// the GPU where N / 128 blocks do not.

#include "nvfp4_decode.cuh"

namespace {

using namespace qerl;

// wgmma m64nBMk16 with A in registers (four 16-bit pairs a thread) and B from shared memory
// (descriptor b): d += A B, fp32 accumulators (BM / 2 a thread).
template <int BM>
struct Wgmma;

// The instruction of one dtype (the two differ only in that word); per BM, its
// placeholders (accumulators, A, B) and its accumulator operands.
#define QERL_WGMMA(N, T) "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " "
#define QERL_WGMMA_A "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)

#define QERL_WGMMA_P64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
#define QERL_WGMMA_D64 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

template <>
struct Wgmma<64> {
  template <bool BF16>
  static __device__ __forceinline__ void run(float (&d)[32], const uint32_t (&a)[4],
                                             uint64_t b) {
    if constexpr (BF16)
      asm volatile(QERL_WGMMA(64, "bf16") QERL_WGMMA_P64 : QERL_WGMMA_D64 : QERL_WGMMA_A);
    else
      asm volatile(QERL_WGMMA(64, "f16") QERL_WGMMA_P64 : QERL_WGMMA_D64 : QERL_WGMMA_A);
  }
};

#define QERL_WGMMA_P128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
#define QERL_WGMMA_D128 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

template <>
struct Wgmma<128> {
  template <bool BF16>
  static __device__ __forceinline__ void run(float (&d)[64], const uint32_t (&a)[4],
                                             uint64_t b) {
    if constexpr (BF16)
      asm volatile(QERL_WGMMA(128, "bf16") QERL_WGMMA_P128 : QERL_WGMMA_D128 : QERL_WGMMA_A);
    else
      asm volatile(QERL_WGMMA(128, "f16") QERL_WGMMA_P128 : QERL_WGMMA_D128 : QERL_WGMMA_A);
  }
};

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

__device__ __forceinline__ void copy_async8(void* smem, const void* gmem, bool valid) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(to), "l"(gmem),
               "r"(valid ? 8 : 0));
}

constexpr int kThreads = 256;  // two warpgroups

constexpr int kRows = 128;  // W rows a block: 64 a warpgroup
constexpr int kStages = 4;

// A stage of the pipeline in shared memory: the codes of 8 strips (16 rows x 1 KB), the
// rows' 8 scale bytes of the quad, then x (BM tokens x 128 columns, wgmma's layout).
constexpr int kScalesAt = kRows * 64;
constexpr int kXAt = kRows * 72;  // a multiple of 1024: the swizzled x starts aligned

template <int BM>
__host__ __device__ constexpr int stage_bytes() {
  return kXAt + BM * 256;
}

template <int BM>
__host__ __device__ constexpr int smem_bytes() {
  return kStages * stage_bytes<BM>() + 1024;  // + room to align
}

// 64 tokens: two blocks share an SM (their registers fit), so one's barrier or decode
// overlaps the other's wgmmas.
template <int BM>
__host__ __device__ constexpr int blocks_per_sm() {
  return BM == 64 ? 2 : 1;
}

// B's descriptor: K-major with the 128-byte swizzle, each 64 columns of the quad a block of
// BM token rows of 128 bytes, 8-row groups 1024 bytes apart (stride byte offset; the
// leading one is unused), a k step 32 bytes into the row.
__device__ __forceinline__ uint64_t x_descriptor(uint32_t at) {
  return ((at & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

struct GemmArgs {
  const uint16_t* x;  // [m, quads * 128], columns in gemm order (zeros past K)
  const uint8_t* pairs;
  const uint8_t* scale;
  const float* global_scale;
  const uint16_t* bias;  // or null
  void* out;             // [splits][m][n]: fp32 if out_f32, else x's dtype
  long long stride_xm, stride_p, stride_s, stride_os, stride_om;
  int m, n, quads, quads_per_split, out_f32;
  float post;  // 2^62 (bf16) or 2^14 (fp16)
};

// The block's output tile, scaled (and its bias added on split 0), through shared memory:
// D's fragment (per 8 tokens j: rows g and g + 8 of the warp's strip, tokens 2t, 2t + 1)
// lands as [token][row], padded 16 bytes a token against bank conflicts, and goes out as
// 16-byte rows of out[token][n0 ..] instead of 2- or 4-byte scattered stores.
template <bool BF16, int BM, typename T>
__device__ __forceinline__ void write_tile(const GemmArgs& a, const float (&acc)[BM / 2],
                                           uint8_t* smem, int m0, int n0, float factor) {
  constexpr int kEl = 16 / sizeof(T), kPitch = kRows + kEl, kPieces = kRows / kEl;
  T* tile = reinterpret_cast<T*>(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const bool bias = a.bias != nullptr && blockIdx.z == 0;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = warp * 16 + g + 8 * (e >> 1), tok = 8 * j + 2 * t + (e & 1);
      float v = acc[4 * j + e] * factor;
      if (bias && n0 + row < a.n) v += to_float<BF16>(a.bias[n0 + row]);
      if constexpr (sizeof(T) == 4)
        tile[tok * kPitch + row] = v;
      else
        tile[tok * kPitch + row] = from_float<BF16>(v);
    }
  __syncthreads();
  T* out = static_cast<T*>(a.out) + blockIdx.z * a.stride_os;
  const bool vectors = reinterpret_cast<uintptr_t>(out) % 16 == 0 && a.stride_om % kEl == 0;
  for (int i = threadIdx.x; i < BM * kPieces; i += kThreads) {
    const int tok = i / kPieces, col = (i % kPieces) * kEl;
    if (m0 + tok >= a.m || n0 + col >= a.n) continue;
    const T* from = tile + tok * kPitch + col;
    T* to = out + (m0 + tok) * a.stride_om + n0 + col;
    if (vectors && n0 + col + kEl <= a.n) {
      *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
    } else {
      for (int c = 0; c < kEl && n0 + col + c < a.n; ++c) to[c] = from[c];
    }
  }
}

template <bool BF16, int BM>
__global__ void __launch_bounds__(kThreads, blocks_per_sm<BM>())
    nvfp4_gemm_kernel(const __grid_constant__ GemmArgs a) {
  constexpr int S = kStages, STAGE = stage_bytes<BM>();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  // The swizzle pattern repeats every 1024 bytes of address: the stages start aligned.
  uint8_t* smem =
      smem_raw + ((1024 - static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw))) & 1023);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * kRows;
  const int q_begin = blockIdx.z * a.quads_per_split;
  const int q_end = min(a.quads, q_begin + a.quads_per_split);
  if (q_begin >= q_end) return;  // (the host sizes splits so that none is empty)

  // What this thread copies each quad: two 16-byte pieces of the codes (tiles past the
  // weight's last are zero-filled), one row's 8 scale bytes (threads < 128), and BM / 16
  // pieces of x: piece c of tokens tok0 + 16i. The 128-byte swizzle puts piece c of token
  // tok at 16 (c % 8 ^ tok % 8) in its row of half c / 8, so a quarter warp (one token's
  // eight pieces of a half) writes a whole 128-byte row, conflict-free.
  const int tiles = (a.n + 15) / 16;
  const uint8_t* code_from[2];
  bool code_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int piece = tid + i * kThreads, tile = n0 / 16 + piece / 64;
    code_ok[i] = tile < tiles;
    code_from[i] = a.pairs + (code_ok[i] ? tile : 0) * a.stride_p + (piece % 64) * 16;
  }
  const int srow = n0 + (tid & (kRows - 1));
  const bool scale_ok = tid < kRows && srow < a.n;
  const uint8_t* scale_from = a.scale + (scale_ok ? srow : 0) * a.stride_s;
  const int c = tid & 15, tok0 = tid >> 4;
  const int x_to = (c >> 3) * (BM * 128) + tok0 * 128 + (((c & 7) ^ (tok0 & 7)) << 4);
  const uint16_t* x_from = a.x + static_cast<long long>(m0 + tok0) * a.stride_xm + c * 8;
  auto load = [&](int slot, int q) {
    uint8_t* s = smem + slot * STAGE;
#pragma unroll
    for (int i = 0; i < 2; ++i)
      copy_async(reinterpret_cast<uint4*>(s + (tid + i * kThreads) * 16),
                 code_from[i] + (code_ok[i] ? 1024ll * q : 0), code_ok[i]);
    if (tid < kRows)
      copy_async8(s + kScalesAt + tid * 8, scale_from + (scale_ok ? 8ll * q : 0), scale_ok);
#pragma unroll
    for (int i = 0; i < BM / 16; ++i) {
      const bool ok = m0 + tok0 + 16 * i < a.m;
      copy_async(reinterpret_cast<uint4*>(s + kXAt + x_to + 2048 * i),
                 ok ? x_from + 16ll * i * a.stride_xm + 128ll * q : a.x, ok);
    }
  };

  float acc[BM / 2];
#pragma unroll
  for (int j = 0; j < BM / 2; ++j) acc[j] = 0.f;

#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (q_begin + i < q_end) load(i, q_begin + i);
    asm volatile("cp.async.commit_group;");
  }
  // Warp w multiplies strip w of the block (rows 16w .. 16w + 15): warpgroup w / 4 holds
  // rows 64 (w / 4) .. + 63 of the block, the wgmma's 64.
  const int code_at = warp * 1024 + g * 64 + t * 16;
  const int scale_at = kScalesAt + (warp * 16 + g) * 8 + 2 * t;
  const uint32_t x_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem + kXAt));

  // Quad q's weight fragments from its slot: step 2 wd + h multiplies pair h of word wd's
  // low group (k slots 2t, 2t + 1) and of its high group (slots 2t + 8, 2t + 9), rows g
  // and g + 8: gemm_order's columns.
  auto decode = [&](uint32_t (&frag)[8][4], int q) {
    const uint8_t* s = smem + ((q - q_begin) % S) * STAGE;
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
  // Quad q: its eight wgmmas go out; while they run, the quad before is waited for, the
  // next quad's copy too, the slot of the quad before (done in both warpgroups after the
  // barrier) refilled, and the next quad decoded into the other fragment registers.
  auto step = [&](int q, const uint32_t (&frag)[8][4], uint32_t (&next)[8][4]) {
    const uint32_t x_slot = x_base + ((q - q_begin) % S) * STAGE;
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 8; ++k)
      Wgmma<BM>::template run<BF16>(
          acc, frag[k], x_descriptor(x_slot + (k >> 2) * BM * 128 + (k & 3) * 32));
    wgmma_commit();
    wgmma_wait<1>();
    if (q + 1 < q_end) {
      asm volatile("cp.async.wait_group %0;" ::"n"(S - 3));
      __syncthreads();
      if (q + S - 1 < q_end) load((q - q_begin + S - 1) % S, q + S - 1);
      asm volatile("cp.async.commit_group;");
      decode(next, q + 1);
    }
  };

  uint32_t frag[2][8][4];
  asm volatile("cp.async.wait_group %0;" ::"n"(S - 2));
  __syncthreads();
  decode(frag[0], q_begin);
  for (int q = q_begin; q < q_end; q += 2) {  // two at a time: the fragments stay in registers
    step(q, frag[0], frag[1]);
    if (q + 1 < q_end) step(q + 1, frag[1], frag[0]);
  }
  wgmma_wait<0>();
  __syncthreads();  // every warp is done with the stages: the output tile goes through them
  const float factor = a.post / *a.global_scale;
  if (a.out_f32)
    write_tile<BF16, BM, float>(a, acc, smem, m0, n0, factor);
  else
    write_tile<BF16, BM, uint16_t>(a, acc, smem, m0, n0, factor);
}

template <bool BF16, int BM>
cudaError_t launch(const GemmArgs& a, int splits, cudaStream_t stream) {
  const dim3 grid((a.m + BM - 1) / BM, (a.n + kRows - 1) / kRows, splits);
  nvfp4_gemm_kernel<BF16, BM><<<grid, kThreads, smem_bytes<BM>(), stream>>>(a);
  return cudaGetLastError();
}

template <bool BF16>
cudaError_t prepare() {
  cudaError_t e = cudaFuncSetAttribute(nvfp4_gemm_kernel<BF16, 64>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       smem_bytes<64>());
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(nvfp4_gemm_kernel<BF16, 128>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<128>());
  return e;
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

// Returns a cudaError_t (0: launched). x is in gemm order, [m, quads * 128]; shapes and
// strides are checked by the caller.
int qerl_nvfp4_gemm(int bf16, const void* x, long long stride_xm, const void* pairs,
                    long long stride_p, const void* scale, long long stride_s,
                    const void* global_scale, const void* bias, void* out, int out_f32,
                    long long stride_os, long long stride_om, int m, int n, int quads,
                    int splits, int bm, int device, void* stream) {
  if (m < 1 || n < 1 || quads < 1 || splits < 1 || (bm != 64 && bm != 128))
    return cudaErrorInvalidValue;
  GemmArgs a{};
  a.x = static_cast<const uint16_t*>(x);
  a.pairs = static_cast<const uint8_t*>(pairs);
  a.scale = static_cast<const uint8_t*>(scale);
  a.global_scale = static_cast<const float*>(global_scale);
  a.bias = static_cast<const uint16_t*>(bias);
  a.out = out;
  a.stride_xm = stride_xm;
  a.stride_p = stride_p;
  a.stride_s = stride_s;
  a.stride_os = stride_os;
  a.stride_om = stride_om;
  a.m = m;
  a.n = n;
  a.quads = quads;
  a.quads_per_split = (quads + splits - 1) / splits;
  a.out_f32 = out_f32;
  a.post = bf16 ? 4611686018427387904.0f : 16384.0f;  // 2^62, 2^14
  const DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  const auto s = static_cast<cudaStream_t>(stream);
  if (bf16) return bm == 64 ? launch<true, 64>(a, splits, s) : launch<true, 128>(a, splits, s);
  return bm == 64 ? launch<false, 64>(a, splits, s) : launch<false, 128>(a, splits, s);
}

const char* qerl_nvfp4_gemm_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // extern "C"
