// The few-row dot product of quant_matmul.cpp for Q4_1 weights (SmolLM2-135M's file holds
// Q4_1 layers) with 512-bit integer vectors: four 32-value blocks (a "quad") an iteration.
//
// The activations are quantized as quantize_rows does (the same codes, scales and sums)
// but laid out for the weight's unpacking, a quad at a time: 128 bytes of codes, then 32
// floats. A Q4_1 block's 16 bytes hold its values 0-15 in their low nibbles and 16-31 in
// their high ones, so a quad's activation codes are its four blocks' values 0-15, then
// their values 16-31: the weight's 64 bytes of nibbles masked with 0x0F, and shifted
// right by 4 and masked, line up with them and no byte moves. VPDPBUSD (unsigned weight
// codes by signed activation codes; VPMADDUBSW + VPMADDWD without VNNI, which cannot
// saturate here: 15 * 127 * 2 < 2^15) leaves block i's dot product in int32 lanes
// 4i..4i+3, scaled there by d_w[i] * d_a[i], with the min term beside it (min_w[i] *
// d_a[i] * sum a[i]: llama.cpp's ggml_vec_dot_q4_1_q8_1). Every integer is exact; only
// the float32 sums' order differs from dot_row's.
//
// Measured (kvscope.bench.quant_matmul's shapes, one thread, the 2-core AMD EPYC dev
// machine, busy): 1.4-1.7x quicker than dot_row where the weight is in cache, 1.15-1.4x
// where it streams from memory, 1.35-1.55x at 4 rows. Q8_0 done the same way (the sign
// trick on each half quad's 64 codes) was no quicker from memory, and 1.2-1.4x slower on
// rows of 18 blocks, so Q8_0 and the other types stay on dot_row.
//
// A row's blocks need not fill its last quad (576 values: 4 quads and 2 blocks): its
// missing activation blocks are zeros, and the weight's bytes past the row are read as
// they are (the next row's) with the missing blocks' scales zeroed, so nothing of them
// counts; at the weight's very end, where reading past could fault, with masked loads.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define KVSCOPE_QUANT_QUADS 1
#endif

#ifdef KVSCOPE_QUANT_QUADS
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

#include "simd.h"

namespace quads {

constexpr int kBlocks = 4;         // blocks a quad
constexpr int64_t kStride = 256;   // bytes of one quad's activations: 128 codes, 32 floats

inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {  // acc + 16 sums of 4 u8*s8
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else  // no saturation: codes <= 15 and |a| <= 127 keep each pair's sum below 2^15
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

inline __mmask64 first_bytes(int64_t count) {  // a mask of the first `count` bytes (0..64)
  return count >= 64 ? ~__mmask64{0} : count <= 0 ? 0 : (__mmask64{1} << count) - 1;
}
// How a quad's bytes are read: all four blocks are the row's (kFull); fewer are, and the
// bytes after them are still the weight's (kPastRow: the next row's bytes are read, and
// the missing blocks' scales zeroed, so the zero activations cancel their codes); fewer
// are, at the weight's end (kMasked: only the row's bytes are read, with masked loads,
// since reading past the weight could fault).
enum class Read { kFull, kPastRow, kMasked };

// 64 bytes at p; with kMasked, only the first `valid` of them (the rest read as zero).
template <Read How>
inline __m512i load64(const uint8_t* p, int64_t valid) {
  if constexpr (How == Read::kMasked) return _mm512_maskz_loadu_epi8(first_bytes(valid), p);
  return _mm512_loadu_si512(p);
}
// Which of 32 half-float lanes, `lanes` a block, belong to the first `blocks` blocks.
inline __mmask32 block_lanes(int blocks, int lanes) {
  return blocks >= 4 ? ~__mmask32{0} : (__mmask32{1} << (blocks * lanes)) - 1;
}

// A quad of weight blocks as the dot products want them, the first `blocks` of them the
// row's.
struct Q4_1Quad {
  static constexpr int kBytes = 20;
  __m512i low, high;  // the four blocks' codes 0-15, then 16-31 (unsigned)
  __m512 scale, min;  // block i's d and min in lanes 4i..4i+3

  template <Read How>
  Q4_1Quad(std::integral_constant<Read, How>, const uint8_t* b, int blocks) {
    const int64_t valid = blocks * kBytes;
    const __m512i head = load64<How>(b, valid), rest = load64<How>(b + 16, valid - 16);
    // the nibbles of block i start at byte 20i + 4: dwords 1, 6, 11 of head, 12 of rest
    const __m512i nibbles = _mm512_permutex2var_epi32(
        head, _mm512_setr_epi32(1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 28, 29, 30, 31), rest);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    low = _mm512_and_si512(nibbles, mask);
    high = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), mask);
    // d of block i is the half at word 10i, its min at word 10i + 1
    const __mmask32 lanes = How == Read::kFull ? ~__mmask32{0} : block_lanes(blocks, 4) * 0x10001u;
    const __m512i halves = _mm512_maskz_permutexvar_epi16(
        lanes,
        _mm512_set_epi16(31, 31, 31, 31, 21, 21, 21, 21, 11, 11, 11, 11, 1, 1, 1, 1,  //
                         30, 30, 30, 30, 20, 20, 20, 20, 10, 10, 10, 10, 0, 0, 0, 0),
        head);
    scale = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
    min = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
  }
  // acc += this quad times one row's quad of activations `a` (kStride bytes).
  void dot(const uint8_t* a, __m512& acc) const {
    const auto* codes = reinterpret_cast<const __m512i*>(a);
    const auto* floats = reinterpret_cast<const float*>(a + 128);
    __m512i sums = dpbusd(_mm512_setzero_si512(), low, _mm512_load_si512(codes));
    sums = dpbusd(sums, high, _mm512_load_si512(codes + 1));
    const __m512 both = _mm512_mul_ps(scale, _mm512_load_ps(floats));  // d_w * d_a
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), both, acc);
    acc = _mm512_fmadd_ps(min, _mm512_load_ps(floats + 16), acc);  // min * d_a * sum a
  }
  // Where block i's 16 activation codes for values 0-15 go in its quad, and those for
  // 16-31; its d_a goes to floats 4i..4i+3 and d_a * sum to float 16 + 4i.
  static constexpr int64_t kLowAt[4] = {0, 16, 32, 48}, kHighAt[4] = {64, 80, 96, 112};
  static void place_scales(float* floats, int i, float scale, float scaled_sum) {
    for (int lane = 0; lane < 4; ++lane) floats[4 * i + lane] = scale;
    floats[16 + 4 * i] = scaled_sum;
  }
};

// Rows of x quantized 32 values at a time (as quantize_rows: the same codes and scales)
// into quads laid out for the weight type L; zeros where a row's blocks end mid-quad.
struct QuadActivations {
  std::unique_ptr<uint8_t, decltype(&std::free)> bytes{nullptr, &std::free};
  int64_t quads = 0;  // a row's
  const uint8_t* quad(int64_t row, int64_t q) const { return bytes.get() + (row * quads + q) * kStride; }
};

template <class L, typename T>
QuadActivations quantize_quads(const T* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / 32;
  QuadActivations a;
  a.quads = (blocks + kBlocks - 1) / kBlocks;
  const size_t size = static_cast<size_t>(rows * a.quads * kStride);
  a.bytes.reset(static_cast<uint8_t*>(std::aligned_alloc(64, size)));
  TORCH_CHECK(a.bytes, "quant_linear: out of memory for the activations");
  std::memset(a.bytes.get(), 0, size);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const T* v = x + r * k + blk * 32;
      const __m512 low = simd::load(v), high = simd::load(v + 16);
      const __m512 magnitude = _mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high));
      const float amax = _mm512_reduce_max_ps(magnitude);
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      // rounded to nearest even, as std::nearbyint in the default rounding mode
      const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, _mm512_set1_ps(inverse)));
      const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, _mm512_set1_ps(inverse)));
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
      uint8_t* quad = a.bytes.get() + (r * a.quads + blk / kBlocks) * kStride;
      const int i = static_cast<int>(blk % kBlocks);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(quad + L::kLowAt[i]), _mm512_cvtepi32_epi8(q_low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(quad + L::kHighAt[i]), _mm512_cvtepi32_epi8(q_high));
      const float scale = amax / 127.0f;
      L::place_scales(reinterpret_cast<float*>(quad + 128), i, scale, scale * static_cast<float>(sum));
    }
  }
  return a;
}

template <Read How>
using ReadAs = std::integral_constant<Read, How>;

// One weight row (`blocks` blocks of L; the weight ends at `end`) dotted with R rows of
// the activations from r0. (Two or four weight rows at once, each its own stream, read
// memory slower here: 1.2-1.8x the time a block.)
template <class L, int R>
void dot_row(const uint8_t* row, const uint8_t* end, int64_t blocks, const QuadActivations& a,
             int64_t r0, float* result) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t full = blocks / kBlocks;
  constexpr int64_t kQuadBytes = kBlocks * L::kBytes;
  for (int64_t q = 0; q < full; ++q) {
    const L w(ReadAs<Read::kFull>{}, row + q * kQuadBytes, kBlocks);
    for (int r = 0; r < R; ++r) w.dot(a.quad(r0 + r, q), acc[r]);
  }
  if (full < a.quads) {
    const int left = static_cast<int>(blocks - full * kBlocks);
    const uint8_t* b = row + full * kQuadBytes;
    if (b + kQuadBytes <= end) {
      const L w(ReadAs<Read::kPastRow>{}, b, left);
      for (int r = 0; r < R; ++r) w.dot(a.quad(r0 + r, full), acc[r]);
    } else {
      const L w(ReadAs<Read::kMasked>{}, b, left);
      for (int r = 0; r < R; ++r) w.dot(a.quad(r0 + r, full), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = _mm512_reduce_add_ps(acc[r]);
}

}  // namespace quads
#endif
