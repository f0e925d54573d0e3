// The vector helpers the CPU kernels share (paged_decode.cpp, elementwise.cpp), written
// once over `simd::V`: 16 float lanes with AVX-512F, 8 with AVX2 and FMA, none (no
// KVSCOPE_SIMD) otherwise, as the build's -march=native finds the CPU.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define KVSCOPE_SIMD 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVSCOPE_AVX512_BF16 1
#endif

#include <cstdint>

namespace {

// Asks for the cache line at p into L1. GCC 12 deletes a loop whose only work is
// __builtin_prefetch (it has no side effect), so on x86 it is an asm statement.
inline void prefetch(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// The same into L2 only: for data wanted a little later, which in L1 would push out the
// data in use now.
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

#ifdef KVSCOPE_SIMD
namespace simd {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__)
constexpr int64_t W = 16;
using V = __m512;
using I = __m512i;
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline V load(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
// v's float32 bits rounded to bfloat16 (nearest even; a NaN stays a quiet NaN), as
// 32-bit words whose high halves are the bfloat16 values.
inline I bf16_bits(V v) {
  const I bits = _mm512_castps_si512(v);
  const I lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const I up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, up, _mm512_set1_epi32(0x7FC00000));
}
inline void store(bf16* p, V v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
// v rounded to bfloat16's precision, as floats.
inline V round_bf16(V v) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(bf16_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V min(V a, V b) { return _mm512_min_ps(a, b); }
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
inline V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline I to_int(V a) { return _mm512_cvttps_epi32(a); }
inline V pow2(I n) {  // 2^n for integer n in float range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
}
// x where the lane's index is below n, else `other`.
inline V below(int64_t n, V x, V other) {
  const __mmask16 keep = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  return _mm512_mask_blend_ps(keep, other, x);
}
inline float hmax(V v) { return _mm512_reduce_max_ps(v); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
// The 16 lanes folded to 8.
inline __m256 fold(V v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
constexpr int64_t W = 8;
using V = __m256;
using I = __m256i;
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline I bf16_bits(V v) {  // as the AVX-512 version above
  const I bits = _mm256_castps_si256(v);
  const I lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const I up = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const V nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(up), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}
inline void store(bf16* p, V v) {
  const I high = _mm256_srli_epi32(bf16_bits(v), 16);
  // packus works within 128-bit halves: gather the two halves' four words first.
  const I packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline V round_bf16(V v) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(bf16_bits(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V min(V a, V b) { return _mm256_min_ps(a, b); }
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline V floor(V a) { return _mm256_floor_ps(a); }
inline I to_int(V a) { return _mm256_cvttps_epi32(a); }
inline V pow2(I n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
inline V below(int64_t n, V x, V other) {
  const V lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_blendv_ps(other, x, _mm256_cmp_ps(lane, set1(static_cast<float>(n)), _CMP_LT_OQ));
}
inline float hmax(V v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float hsum(V v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
inline __m256 fold(V v) { return v; }
#endif

// exp(x), Cephes' range reduction and degree-5 polynomial (relative error ~2e-7).
// Inputs below -87.3 give ~0 rather than 0, which the softmax cannot tell apart.
inline V exp(V x) {
  x = max(min(x, set1(88.37626f)), set1(-87.33654f));
  V n = floor(fmadd(x, set1(1.44269504088896341f), set1(0.5f)));
  x = sub(x, mul(n, set1(0.693359375f)));
  x = sub(x, mul(n, set1(-2.12194440e-4f)));
  V y = set1(1.9875691500e-4f);
  y = fmadd(y, x, set1(1.3981999507e-3f));
  y = fmadd(y, x, set1(8.3334519073e-3f));
  y = fmadd(y, x, set1(4.1665795894e-2f));
  y = fmadd(y, x, set1(1.6666665459e-1f));
  y = fmadd(y, x, set1(5.0000001201e-1f));
  y = fmadd(y, mul(x, x), add(x, set1(1.0f)));
  return mul(y, pow2(to_int(n)));
}

// Eight 8-lane vectors to one vector of their eight sums, in order.
inline __m256 sum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

}  // namespace simd
#endif
}  // namespace
