// GGML-quantized weights (a GGUF file's blocks, kvscope/kernels/ggml_quants.py) multiplied
// without a float copy of the weight:
//
//   quant_linear(out, x, data, qtype, in_features, bias):  out = x W^T + bias for a few
//       rows of x (a decode step). Each row of x is first quantized to 8 bits a group of
//       32 (one float scale a group, round to nearest; llama.cpp's Q8_0/Q8_1), then
//       every weight row is read once, its groups of 32 codes dotted with the rows' codes
//       in 8-bit integers (AVX-512 VNNI's VPDPBUSD, else AVX2's VPMADDUBSW + VPMADDWD:
//       llama.cpp's vec_dot_q4_1_q8_1 and kin), and each group's int32 sums scaled in
//       float32. Output rows split over at::parallel_for. Q4_1 with AVX-512 takes four
//       groups at a time instead (quant_quads.h), on activations laid out for it.
//   quant_dequantize(out, data, qtype):  W as floats (float32 or bfloat16), for the
//       slabs a many-row multiply hands to oneDNN.
//
// Every block type is described once, as groups of 32 values: value = scale * code + min,
// where `code` is an integer (signed for the types with no min: Q8_0, Q4_0, Q5_0, Q6_K;
// unsigned 0..63 for Q4_1, Q5_1, Q4_K, Q5_K), `scale` may differ between the group's
// two halves of 16 (Q6_K), and `min` is one float a group. So the dot product of a group
// with an activation group (scale da, codes a, sum of codes sa) is
//   da * (lo * sum(code*a over the first 16) + hi * sum(over the last 16)) + min * da * sa.
// Signed codes go through the unsigned-by-signed instruction as |code| * sign(a, code).
// Without AVX2 the same groups are dotted in plain integer loops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "quant_quads.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#include "ops.h"

#if defined(__AVX2__)
#define KVSCOPE_QUANT_SIMD 1
#endif

namespace {

using bf16 = c10::BFloat16;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // c10::Half converts in software
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// A group of 32 values: scale `lo` for the first 16 codes, `hi` for the rest, then + min.
struct Group {
  float lo, hi, min;
};

// Q4_K's and Q5_K's 6-bit scale and min of group j from their 12 packed bytes.
inline void k_scale_min(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Each type: kElems values in kBytes; groups() fills the kElems / 32 groups' scales;
// codes(b, g, c) writes group g's 32 codes; simd_codes(b, g) gives them as 32 bytes.
#ifdef KVSCOPE_QUANT_SIMD
inline __m256i nibbles16(const uint8_t* p) {  // 16 bytes: the low nibbles, then the high
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}
inline __m256i nibbles32(const uint8_t* p, bool high) {  // 32 bytes' low or high nibbles
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (high) raw = _mm256_srli_epi16(raw, 4);
  return _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));
}
inline __m256i bit4_of_32(const uint8_t* p) {  // bit i of the 32-bit word at p -> 0x10 in byte i
  uint32_t word;
  std::memcpy(&word, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(word)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(0x10));
}
inline __m256i shifted_bits(const uint8_t* p, int shift, int mask) {  // ((p[i] >> shift) & mask) << 4
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i bits = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(shift)),
                                        _mm256_set1_epi8(static_cast<char>(mask)));
  return _mm256_slli_epi16(bits, 4);
}
#endif

struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34;
  static constexpr bool kSigned = true;
  static constexpr bool kHalfScales = false;
  static void groups(const uint8_t* b, Group* g) { g[0] = {half_at(b), half_at(b), 0.0f}; }
  static void codes(const uint8_t* b, int, int* c) {
    for (int i = 0; i < 32; ++i) c[i] = static_cast<int8_t>(b[2 + i]);
  }
#ifdef KVSCOPE_QUANT_SIMD
  static __m256i simd_codes(const uint8_t* b, int) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  }
#endif
};

struct Q4_0 {
  static constexpr int kElems = 32, kBytes = 18;
  static constexpr bool kSigned = true;
  static constexpr bool kHalfScales = false;
  static void groups(const uint8_t* b, Group* g) { g[0] = {half_at(b), half_at(b), 0.0f}; }
  static void codes(const uint8_t* b, int, int* c) {
    for (int i = 0; i < 16; ++i) c[i] = (b[2 + i] & 0x0F) - 8, c[i + 16] = (b[2 + i] >> 4) - 8;
  }
#ifdef KVSCOPE_QUANT_SIMD
  static __m256i simd_codes(const uint8_t* b, int) {
    return _mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8));
  }
#endif
};

struct Q4_1 {
  static constexpr int kElems = 32, kBytes = 20;
  static constexpr bool kSigned = false;
  static constexpr bool kHalfScales = false;
  static void groups(const uint8_t* b, Group* g) { g[0] = {half_at(b), half_at(b), half_at(b + 2)}; }
  static void codes(const uint8_t* b, int, int* c) {
    for (int i = 0; i < 16; ++i) c[i] = b[4 + i] & 0x0F, c[i + 16] = b[4 + i] >> 4;
  }
#ifdef KVSCOPE_QUANT_SIMD
  static __m256i simd_codes(const uint8_t* b, int) { return nibbles16(b + 4); }
#endif
};

inline void five_bit_codes(const uint8_t* qh, const uint8_t* qs, int offset, int* c) {
  uint32_t high;
  std::memcpy(&high, qh, 4);
  for (int i = 0; i < 16; ++i) {
    c[i] = ((qs[i] & 0x0F) | (((high >> i) & 1) << 4)) - offset;
    c[i + 16] = ((qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4)) - offset;
  }
}

struct Q5_0 {
  static constexpr int kElems = 32, kBytes = 22;
  static constexpr bool kSigned = true;
  static constexpr bool kHalfScales = false;
  static void groups(const uint8_t* b, Group* g) { g[0] = {half_at(b), half_at(b), 0.0f}; }
  static void codes(const uint8_t* b, int, int* c) { five_bit_codes(b + 2, b + 6, 16, c); }
#ifdef KVSCOPE_QUANT_SIMD
  static __m256i simd_codes(const uint8_t* b, int) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles16(b + 6), bit4_of_32(b + 2)),
                           _mm256_set1_epi8(16));
  }
#endif
};

struct Q5_1 {
  static constexpr int kElems = 32, kBytes = 24;
  static constexpr bool kSigned = false;
  static constexpr bool kHalfScales = false;
  static void groups(const uint8_t* b, Group* g) { g[0] = {half_at(b), half_at(b), half_at(b + 2)}; }
  static void codes(const uint8_t* b, int, int* c) { five_bit_codes(b + 4, b + 8, 0, c); }
#ifdef KVSCOPE_QUANT_SIMD
  static __m256i simd_codes(const uint8_t* b, int) {
    return _mm256_or_si256(nibbles16(b + 8), bit4_of_32(b + 4));
  }
#endif
};

// Q4_K and Q5_K: d, dmin, 12 bytes of scales and mins, (Q5_K: 32 bytes of fifth bits,)
// 128 bytes of nibbles: group g is the low (g even) or high nibbles of 32 bytes g / 2.
inline void k_groups(const uint8_t* b, Group* g) {
  const float d = half_at(b), dmin = half_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    k_scale_min(b + 4, j, scale, min);
    const float s = d * static_cast<float>(scale);
    g[j] = {s, s, -(dmin * static_cast<float>(min))};
  }
}

struct Q4_K {
  static constexpr int kElems = 256, kBytes = 144;
  static constexpr bool kSigned = false;
  static constexpr bool kHalfScales = false;
  static void groups(const uint8_t* b, Group* g) { k_groups(b, g); }
  static void codes(const uint8_t* b, int g, int* c) {
    const uint8_t* qs = b + 16 + 32 * (g / 2);
    for (int i = 0; i < 32; ++i) c[i] = (g & 1) ? qs[i] >> 4 : qs[i] & 0x0F;
  }
#ifdef KVSCOPE_QUANT_SIMD
  static __m256i simd_codes(const uint8_t* b, int g) { return nibbles32(b + 16 + 32 * (g / 2), g & 1); }
#endif
};

struct Q5_K {
  static constexpr int kElems = 256, kBytes = 176;
  static constexpr bool kSigned = false;
  static constexpr bool kHalfScales = false;
  static void groups(const uint8_t* b, Group* g) { k_groups(b, g); }
  static void codes(const uint8_t* b, int g, int* c) {
    const uint8_t* qs = b + 48 + 32 * (g / 2);
    for (int i = 0; i < 32; ++i)
      c[i] = ((g & 1) ? qs[i] >> 4 : qs[i] & 0x0F) | (((b[16 + i] >> g) & 1) << 4);
  }
#ifdef KVSCOPE_QUANT_SIMD
  static __m256i simd_codes(const uint8_t* b, int g) {
    return _mm256_or_si256(nibbles32(b + 48 + 32 * (g / 2), g & 1), shifted_bits(b + 16, g, 1));
  }
#endif
};

// Q6_K: 128 bytes of low nibbles, 64 of top bit pairs, 16 int8 scales (one per 16
// values), d. Half h (128 values) of group g = 4h + k: nibbles of bytes 64h + 32(k & 1)
// (low for k < 2), top bits (>> 2k) of bytes 128 + 32h.
struct Q6_K {
  static constexpr int kElems = 256, kBytes = 210;
  static constexpr bool kSigned = true;
  static constexpr bool kHalfScales = true;
  static void groups(const uint8_t* b, Group* g) {
    const float d = half_at(b + 208);
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 8; ++j)
      g[j] = {d * static_cast<float>(scales[2 * j]), d * static_cast<float>(scales[2 * j + 1]), 0.0f};
  }
  static void codes(const uint8_t* b, int g, int* c) {
    const int h = g / 4, k = g % 4;
    const uint8_t* ql = b + 64 * h + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    for (int i = 0; i < 32; ++i)
      c[i] = ((k < 2 ? ql[i] & 0x0F : ql[i] >> 4) | (((qh[i] >> (2 * k)) & 3) << 4)) - 32;
  }
#ifdef KVSCOPE_QUANT_SIMD
  static __m256i simd_codes(const uint8_t* b, int g) {
    const int h = g / 4, k = g % 4;
    const __m256i low = nibbles32(b + 64 * h + 32 * (k & 1), k >= 2);
    return _mm256_sub_epi8(_mm256_or_si256(low, shifted_bits(b + 128 + 32 * h, 2 * k, 3)),
                           _mm256_set1_epi8(32));
  }
#endif
};

template <typename F>
void with_type(const std::string& qtype, F&& f) {
  if (qtype == "Q8_0") return f(Q8_0{});
  if (qtype == "Q4_0") return f(Q4_0{});
  if (qtype == "Q4_1") return f(Q4_1{});
  if (qtype == "Q5_0") return f(Q5_0{});
  if (qtype == "Q5_1") return f(Q5_1{});
  if (qtype == "Q4_K") return f(Q4_K{});
  if (qtype == "Q5_K") return f(Q5_K{});
  if (qtype == "Q6_K") return f(Q6_K{});
  TORCH_CHECK(false, "quant_matmul: no kernel for GGML type ", qtype);
}

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return static_cast<float>(x); }

// The rows of x quantized a group of 32 at a time: codes, each group's scale d and
// d * (sum of its codes).

struct Activations {
  std::vector<int8_t> codes;
  std::vector<float> scale, scaled_sum;
  int64_t groups;  // a row's
};

template <typename T>
Activations quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t groups = rows * k / 32;
  Activations a{std::vector<int8_t>(rows * k), std::vector<float>(groups),
                std::vector<float>(groups), k / 32};
  at::parallel_for(0, groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float v[32], amax = 0.0f;
      for (int j = 0; j < 32; ++j) v[j] = widen(x[i * 32 + j]), amax = std::max(amax, std::fabs(v[j]));
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int q = static_cast<int>(std::nearbyint(v[j] * inverse));
        a.codes[i * 32 + j] = static_cast<int8_t>(q);
        sum += q;
      }
      a.scale[i] = amax / 127.0f;
      a.scaled_sum[i] = a.scale[i] * static_cast<float>(sum);
    }
  });
  return a;
}

#ifdef KVSCOPE_QUANT_SIMD
inline __m256i dot_u8_s8(__m256i u, __m256i s) {  // 8 sums of 4 products
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
// One weight row dotted with R rows of the activations from r0, a group at a time: the
// group's int32 dot products scaled into float32 sums (a chunk of 8 groups summed in
// integers first and scaled at once measured slower here: 1.5x at 4 rows).
template <class Q, int R>
void dot_row(const uint8_t* row, const Activations& a, int64_t r0, float* result) {
  constexpr int G = Q::kElems / 32;
  __m256 acc[R];
  float mins[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < a.groups / G; ++blk) {
    const uint8_t* b = row + blk * Q::kBytes;
    Group groups[G];
    Q::groups(b, groups);
    for (int g = 0; g < G; ++g) {
      const __m256i signs = Q::simd_codes(b, g);
      const __m256i codes = Q::kSigned ? _mm256_sign_epi8(signs, signs) : signs;
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * a.groups + blk * G + g;
        __m256i act = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.codes[i * 32]));
        if constexpr (Q::kSigned) act = _mm256_sign_epi8(act, signs);
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(codes, act));
        __m256 scale;
        if constexpr (Q::kHalfScales) {  // the group's halves have scales of their own
          scale = _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(groups[g].hi), _mm_set1_ps(groups[g].lo)),
                                _mm256_set1_ps(a.scale[i]));
        } else {
          scale = _mm256_set1_ps(groups[g].lo * a.scale[i]);
        }
        acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
        if constexpr (!Q::kSigned) mins[r] += groups[g].min * a.scaled_sum[i];
      }
    }
  }
  for (int r = 0; r < R; ++r) result[r] = hsum(acc[r]) + mins[r];
}
#else
// The same in plain loops, a group at a time.
template <class Q, int R>
void dot_row(const uint8_t* row, const Activations& a, int64_t r0, float* result) {
  constexpr int G = Q::kElems / 32;
  for (int r = 0; r < R; ++r) result[r] = 0.0f;
  for (int64_t blk = 0; blk < a.groups / G; ++blk) {
    const uint8_t* b = row + blk * Q::kBytes;
    Group groups[G];
    Q::groups(b, groups);
    for (int g = 0; g < G; ++g) {
      int codes[32];
      Q::codes(b, g, codes);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * a.groups + blk * G + g;
        const int8_t* q = &a.codes[i * 32];
        int lo = 0, hi = 0;
        for (int j = 0; j < 16; ++j) lo += codes[j] * q[j], hi += codes[j + 16] * q[j + 16];
        result[r] += a.scale[i] * (groups[g].lo * static_cast<float>(lo) +
                                   groups[g].hi * static_cast<float>(hi)) +
                     groups[g].min * a.scaled_sum[i];
      }
    }
  }
}
#endif

// Rows of x at a time through each weight row: as many as registers hold.
constexpr int64_t kRowTile = 4;

#ifdef KVSCOPE_QUANT_QUADS
// The weight types quant_quads.h multiplies four blocks at a time.
template <class Q> struct QuadOf { using type = void; };
template <> struct QuadOf<Q4_1> { using type = quads::Q4_1Quad; };

template <class L, typename T>
void quad_rows(T* out, const T* x, const uint8_t* w, const T* bias, int64_t rows, int64_t n,
               int64_t k, int64_t row_bytes) {
  const quads::QuadActivations a = quads::quantize_quads<L>(x, rows, k);
  const uint8_t* weight_end = w + n * row_bytes;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float result[kRowTile];
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* row = w + j * row_bytes;
      const float b = bias ? widen(bias[j]) : 0.0f;
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int64_t tile = std::min(kRowTile, rows - r0);
        switch (tile) {
          case 4: quads::dot_row<L, 4>(row, weight_end, k / 32, a, r0, result); break;
          case 3: quads::dot_row<L, 3>(row, weight_end, k / 32, a, r0, result); break;
          case 2: quads::dot_row<L, 2>(row, weight_end, k / 32, a, r0, result); break;
          default: quads::dot_row<L, 1>(row, weight_end, k / 32, a, r0, result); break;
        }
        for (int64_t r = 0; r < tile; ++r) out[(r0 + r) * n + j] = static_cast<T>(result[r] + b);
      }
    }
  });
}
#endif

template <class Q, typename T>
void linear_rows(T* out, const T* x, const uint8_t* w, const T* bias, int64_t rows, int64_t n,
                 int64_t k, int64_t row_bytes) {
#ifdef KVSCOPE_QUANT_QUADS
  using L = typename QuadOf<Q>::type;
  if constexpr (!std::is_void_v<L>) return quad_rows<L, T>(out, x, w, bias, rows, n, k, row_bytes);
#endif
  const Activations a = quantize_rows(x, rows, k);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float result[kRowTile];
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* row = w + j * row_bytes;
      const float b = bias ? widen(bias[j]) : 0.0f;
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int64_t tile = std::min(kRowTile, rows - r0);
        switch (tile) {
          case 4: dot_row<Q, 4>(row, a, r0, result); break;
          case 3: dot_row<Q, 3>(row, a, r0, result); break;
          case 2: dot_row<Q, 2>(row, a, r0, result); break;
          default: dot_row<Q, 1>(row, a, r0, result); break;
        }
        for (int64_t r = 0; r < tile; ++r) out[(r0 + r) * n + j] = static_cast<T>(result[r] + b);
      }
    }
  });
}

// Group g of block b as 32 values into o (plain loops, which the compiler vectorises:
// faster here than the codes' vector path converted by hand).
template <class Q, typename T>
void dequantize_group(const uint8_t* b, int g, const Group& group, T* o) {
  int codes[32];
  Q::codes(b, g, codes);
  for (int i = 0; i < 32; ++i) {
    const float scale = i < 16 ? group.lo : group.hi;
    o[i] = static_cast<T>(scale * static_cast<float>(codes[i]) + group.min);
  }
}

// Each weight row's values, scale * code + min, into a row of out.
template <class Q, typename T>
void dequantize_rows(T* out, const uint8_t* w, int64_t n, int64_t k, int64_t row_bytes) {
  constexpr int G = Q::kElems / 32;
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t blk = 0; blk < k / Q::kElems; ++blk) {
        const uint8_t* b = w + j * row_bytes + blk * Q::kBytes;
        Group groups[G];
        Q::groups(b, groups);
        for (int g = 0; g < G; ++g)
          dequantize_group<Q, T>(b, g, groups[g], out + j * k + blk * Q::kElems + g * 32);
      }
    }
  });
}

void check_weight(const at::Tensor& data, int64_t n, int64_t row_bytes) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              "quant_matmul: the weight's blocks must be contiguous uint8 rows");
  TORCH_CHECK(data.size(0) == n && data.size(1) == row_bytes, "quant_matmul: the weight has ",
              data.size(0), " rows of ", data.size(1), " bytes; expected ", n, " of ", row_bytes);
}

void quant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& data,
                  const std::string& qtype, int64_t k, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k, "quant_linear: x must be (rows, ", k, ")");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.size(0) == x.size(0),
              "quant_linear: out must be contiguous (rows, n) of x's dtype");
  TORCH_CHECK(!bias || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                        bias->numel() == out.size(1)),
              "quant_linear: bias must be (n,) of x's dtype");
  const int64_t rows = x.size(0), n = out.size(1);
  with_type(qtype, [&](auto type) {
    using Q = decltype(type);
    TORCH_CHECK(k % Q::kElems == 0, "quant_linear: ", qtype, " needs in_features % ", Q::kElems, " == 0");
    check_weight(data, n, k / Q::kElems * Q::kBytes);
    const auto* w = data.data_ptr<uint8_t>();
    if (x.scalar_type() == at::kFloat) {
      linear_rows<Q, float>(out.data_ptr<float>(), x.data_ptr<float>(), w,
                            bias ? bias->data_ptr<float>() : nullptr, rows, n, k, data.size(1));
    } else {
      TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quant_linear: x must be float32 or bfloat16");
      linear_rows<Q, bf16>(out.data_ptr<bf16>(), x.data_ptr<bf16>(), w,
                           bias ? bias->data_ptr<bf16>() : nullptr, rows, n, k, data.size(1));
    }
  });
}

void quant_dequantize(at::Tensor out, const at::Tensor& data, const std::string& qtype) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "quant_dequantize: out must be contiguous (n, k)");
  const int64_t n = out.size(0), k = out.size(1);
  with_type(qtype, [&](auto type) {
    using Q = decltype(type);
    TORCH_CHECK(k % Q::kElems == 0, "quant_dequantize: ", qtype, " needs k % ", Q::kElems, " == 0");
    check_weight(data, n, k / Q::kElems * Q::kBytes);
    const auto* w = data.data_ptr<uint8_t>();
    if (out.scalar_type() == at::kFloat) {
      dequantize_rows<Q, float>(out.data_ptr<float>(), w, n, k, data.size(1));
    } else {
      TORCH_CHECK(out.scalar_type() == at::kBFloat16, "quant_dequantize: out must be float32 or bfloat16");
      dequantize_rows<Q, bf16>(out.data_ptr<bf16>(), w, n, k, data.size(1));
    }
  });
}

}  // namespace

// The entry points ops.h declares, for the library's other files.
void kvscope_ops::quant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& data,
                               const std::string& qtype, int64_t k,
                               const std::optional<at::Tensor>& bias) {
  ::quant_linear(out, x, data, qtype, k, bias);
}

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor data, str qtype, int in_features, Tensor? bias) -> ()");
  m.def("quant_dequantize(Tensor(a!) out, Tensor data, str qtype) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
