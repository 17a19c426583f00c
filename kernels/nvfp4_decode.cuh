// What the NVFP4 CUDA kernels share: the word decode (nvfp4_layout's shuffle), the scale
// conversion, the packed multiply, 16-byte async copies, 16-bit float conversions and the
// device guard of their entry points.
// Included by nvfp4_gemv.cu (mma.sync, M <= 32) and nvfp4_gemm.cu (wgmma, Hopper).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace qerl {

struct alignas(16) Vec4 {
  uint32_t v[4];
};

// A shared-memory pointer as the 32-bit address PTX takes.
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void copy_async(uint4* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(valid ? 16 : 0));  // 0 bytes read: the 16 are zero-filled
}

// A word of codes -> four 16-bit pairs (L0 L1, L2 L3, H0 H1, H2 H3; nvfp4_layout's word
// shuffle): the E2M1 magnitude at bits 6-8 and the sign at bit 15 of each half, a bf16 of
// value E2M1 * 2^-126 (code 1 lands on a subnormal). fp16 moves the magnitude to bits 9-11
// (E2M1 * 2^-14).
// The constants are nvfp4_layout's CODE_BITS, ROTATIONS and SPREAD.
template <bool BF16>
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t (&d)[4]) {
  constexpr uint32_t kM = 0x81C081C0u;
  d[0] = w & kM;
  d[1] = __funnelshift_l(w, w, 10) & kM;
  d[2] = __funnelshift_l(w, w, 13) & kM;
  d[3] = ((w & 0x001B001Bu) * 0x1084u) & kM;  // three shifted copies, no carries
  if (!BF16)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] = ((d[i] << 3) & 0x0E000E00u) | (d[i] & 0x80008000u);
}

template <bool BF16>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  uint32_t d;
  if (BF16) {
    // fma with -0 (sm_80+; mul.bf16x2 needs sm_90): exact, subnormals kept.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  } else {
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}

// Two fp8 scales -> each broadcast to a 16-bit pair in x's dtype (bf16: times 2^64).
template <bool BF16>
__device__ __forceinline__ void scale_pairs(uint32_t s, uint32_t& lo, uint32_t& hi) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(s), __NV_E4M3);
  uint32_t bits;
  memcpy(&bits, &h, 4);
  if (BF16) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&bits));
    const float up = 18446744073709551616.0f;  // 2^64
    const __nv_bfloat162 l = __floats2bfloat162_rn(f.x * up, f.x * up);
    const __nv_bfloat162 u = __floats2bfloat162_rn(f.y * up, f.y * up);
    memcpy(&lo, &l, 4);
    memcpy(&hi, &u, 4);
  } else {
    lo = __byte_perm(bits, 0, 0x1010);
    hi = __byte_perm(bits, 0, 0x3232);
  }
}

template <bool BF16>
__device__ __forceinline__ float to_float(uint16_t v) {
  if (BF16) return __uint_as_float(static_cast<uint32_t>(v) << 16);
  __half h;
  memcpy(&h, &v, 2);
  return __half2float(h);
}

template <bool BF16>
__device__ __forceinline__ uint16_t from_float(float v) {
  uint16_t r;
  if (BF16) {
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    memcpy(&r, &b, 2);
  } else {
    const __half h = __float2half_rn(v);
    memcpy(&r, &h, 2);
  }
  return r;
}

// The tensors' device, current for one call and then the caller's again, as torch's device
// guard does: a launch on cuda:1 must not move torch's current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    error_ = cudaSetDevice(device);
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = 0;
  cudaError_t error_;
};

}  // namespace qerl
