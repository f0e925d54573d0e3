// The decoder's elementwise steps fused, so that each is one pass over its rows instead
// of several whole-tensor passes (each a trip through memory for a prefill's rows):
//
//   silu_and_mul(out, x):       out = silu(x[:, :n]) * x[:, n:]   (the MLP's gate and up)
//   rms_norm(out, x, w, eps):   out = w * (x / sqrt(mean(x^2) + eps))
//   rope_and_cache(qk, v, cos, sin, slots, key_cache, value_cache):
//       rotates q and k heads in place (Hugging Face's rotary embedding, rounded as
//       kvscope/kernels/rope.py's `apply_rotary` rounds), then writes the rotated k heads
//       and the v heads into the paged cache at `slots` (what `write_slots` does)
//   small_linear(out, x, w, bias):   out = x w^T + bias for a few bfloat16 rows (a decode
//       step of one or two sequences): one pass over w's rows, each dotted with every
//       row of x (VDPBF16PS where the CPU has it, float32 sums), rounded once
//
// Each rounds where torch's unfused ops round, so a bfloat16 result differs from theirs
// only where a float32 intermediate (exp, the sum of squares, in another order) lands
// on the other side of a bfloat16 rounding boundary: silu is rounded to the dtype
// before the product; the normalised row is rounded before the weight multiplies it
// (Hugging Face's RMSNorm). float32 and bfloat16, rows split over at::parallel_for.
// Checked against torch when the library loads (kvscope/kernels/cpu_decode.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <type_traits>
#include "ops.h"

namespace {

using bf16 = c10::BFloat16;

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return static_cast<float>(x); }

// x rounded to T's precision (round to nearest even, as torch rounds), as a float.
template <typename T>
inline float rounded(float x) {
  if constexpr (std::is_same_v<T, bf16>) return static_cast<float>(bf16(x));
  return x;
}

// silu(gate) * up for the n columns of each row: vectorised where the build has a
// vector path, plain loops for the rest of a row and otherwise.
template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t n, int64_t xs, int64_t os) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * xs;
      const T* up = gate + n;
      T* o = out + r * os;
      int64_t i = 0;
#ifdef KVSCOPE_SIMD
      using namespace simd;
      for (; i + W <= n; i += W) {
        const V g = load(gate + i);
        V silu = div(g, add(set1(1.0f), exp(sub(zero(), g))));
        if constexpr (std::is_same_v<T, bf16>) silu = round_bf16(silu);
        store(o + i, mul(silu, load(up + i)));
      }
#endif
      for (; i < n; ++i) {
        const float g = widen(gate[i]);
        const float silu = rounded<T>(g / (1.0f + std::exp(-g)));
        o[i] = static_cast<T>(silu * widen(up[i]));
      }
    }
  });
}

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* weight, int64_t rows, int64_t n, int64_t xs,
                   int64_t os, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * xs;
      T* o = out + r * os;
      float lanes[16] = {};  // partial sums, so the loop vectorises without reassociating
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 16; ++k) lanes[k] += widen(row[i + k]) * widen(row[i + k]);
      float sum = 0;
      for (; i < n; ++i) sum += widen(row[i]) * widen(row[i]);
      for (float lane : lanes) sum += lane;
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
      for (int64_t j = 0; j < n; ++j)
        o[j] = static_cast<T>(widen(weight[j]) * rounded<T>(widen(row[j]) * inv));
    }
  });
}

// One token's rotary embedding on each of its `heads` heads of `dim` (in place):
// x * cos, then x[half:] * sin taken from the first half and x[:half] * sin added to the
// second, each product and each sum rounded to T as torch's ops round them.
template <typename T>
inline void rotate_heads(T* x, int64_t heads, int64_t dim, const T* cos, const T* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* lo = x + h * dim;
    T* hi = lo + half;
    int64_t i = 0;
#ifdef KVSCOPE_SIMD
    using namespace simd;
    for (; i + W <= half; i += W) {
      const V a = load(lo + i), b = load(hi + i);
      const V s = load(sin + i);
      V a_cos = mul(a, load(cos + i)), b_cos = mul(b, load(cos + half + i));
      V b_sin = mul(b, s), a_sin = mul(a, s);
      if constexpr (std::is_same_v<T, bf16>) {
        a_cos = round_bf16(a_cos), b_cos = round_bf16(b_cos);
        b_sin = round_bf16(b_sin), a_sin = round_bf16(a_sin);
      }
      store(lo + i, sub(a_cos, b_sin));
      store(hi + i, add(b_cos, a_sin));
    }
#endif
    for (; i < half; ++i) {
      const float a = widen(lo[i]), b = widen(hi[i]), s = widen(sin[i]);
      const float a_cos = rounded<T>(a * widen(cos[i])), b_cos = rounded<T>(b * widen(cos[half + i]));
      lo[i] = static_cast<T>(a_cos - rounded<T>(b * s));
      hi[i] = static_cast<T>(b_cos + rounded<T>(a * s));
    }
  }
}

// A paged cache ([blocks, block_size, kv_heads, dim], any strides but the last) as
// addresses: slot s is block s / block_size, offset s % block_size.
template <typename T>
struct CacheView {
  T* base;
  int64_t block_size, block_stride, slot_stride, head_stride;
  T* at(int64_t slot, int64_t head) const {
    return base + (slot / block_size) * block_stride + (slot % block_size) * slot_stride +
           head * head_stride;
  }
};

template <typename T>
CacheView<T> cache_view(const at::Tensor& cache) {
  return {cache.data_ptr<T>(), cache.size(1), cache.stride(0), cache.stride(1), cache.stride(2)};
}

template <typename T>
void rope_and_cache_rows(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, const int64_t* slots, const at::Tensor& key_cache,
                         const at::Tensor& value_cache) {
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2);
  const int64_t kv_heads = v.size(1), q_heads = heads - kv_heads;
  T* qk_data = qk.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  const T* cos_data = cos.data_ptr<T>();
  const T* sin_data = sin.data_ptr<T>();
  const int64_t qk_row = qk.stride(0), v_row = v.stride(0), table_row = cos.stride(0);
  const CacheView<T> keys = cache_view<T>(key_cache), values = cache_view<T>(value_cache);
  const size_t head_bytes = dim * sizeof(T);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qk_data + t * qk_row;
      rotate_heads(row, heads, dim, cos_data + t * table_row, sin_data + t * table_row);
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(keys.at(slots[t], h), row + (q_heads + h) * dim, head_bytes);
        std::memcpy(values.at(slots[t], h), v_data + t * v_row + h * dim, head_bytes);
      }
    }
  });
}

void rope_and_cache(at::Tensor qk, const at::Tensor& v, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& slots, at::Tensor key_cache,
                    at::Tensor value_cache) {
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "qk: [tokens, heads, dim], v: [tokens, kv_heads, dim], caches: "
              "[blocks, block_size, kv_heads, dim]");
  const int64_t tokens = qk.size(0), dim = qk.size(2), kv_heads = v.size(1);
  TORCH_CHECK(dim % 2 == 0 && v.size(0) == tokens && v.size(2) == dim && qk.size(1) > kv_heads,
              "qk holds the query heads then the kv heads of v, of one even dim");
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == dim && v.stride(2) == 1 && v.stride(1) == dim,
              "each token's heads must be contiguous");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == tokens &&
                  cos.size(1) == dim && cos.stride(1) == 1 && sin.strides() == cos.strides(),
              "cos, sin: [tokens, dim] with contiguous rows");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens && slots.is_contiguous() &&
                  slots.scalar_type() == at::kLong,
              "slots: contiguous int64 [tokens]");
  for (const at::Tensor& cache : {std::cref(key_cache), std::cref(value_cache)}) {
    TORCH_CHECK(cache.sizes() == key_cache.sizes() && cache.size(2) == kv_heads &&
                    cache.size(3) == dim && cache.stride(3) == 1,
                "the caches: [blocks, block_size, kv_heads, dim] with contiguous heads");
  }
  const auto dtype = qk.scalar_type();
  for (const at::Tensor& t :
       {std::cref(v), std::cref(cos), std::cref(sin), std::cref(key_cache), std::cref(value_cache)}) {
    TORCH_CHECK(t.scalar_type() == dtype, "every tensor but slots must have qk's dtype");
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the cache");
  }
  if (dtype == at::kBFloat16) {
    rope_and_cache_rows<bf16>(qk, v, cos, sin, slot, key_cache, value_cache);
  } else if (dtype == at::kFloat) {
    rope_and_cache_rows<float>(qk, v, cos, sin, slot, key_cache, value_cache);
  } else {
    TORCH_CHECK(false, "rope_and_cache supports float32 and bfloat16, not ", dtype);
  }
}

void check_rows(const at::Tensor& out, const at::Tensor& x, int64_t out_cols) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "x and out: [rows, columns]");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == out_cols, "out has the wrong shape");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "x and out must share a dtype");
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x: [rows, 2 * n]");
  const int64_t n = x.size(1) / 2;
  check_rows(out, x, n);
  if (x.scalar_type() == at::kBFloat16) {
    silu_and_mul_rows(out.data_ptr<bf16>(), x.data_ptr<bf16>(), x.size(0), n, x.stride(0),
                      out.stride(0));
  } else if (x.scalar_type() == at::kFloat) {
    silu_and_mul_rows(out.data_ptr<float>(), x.data_ptr<float>(), x.size(0), n, x.stride(0),
                      out.stride(0));
  } else {
    TORCH_CHECK(false, "silu_and_mul supports float32 and bfloat16, not ", x.scalar_type());
  }
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(out, x, x.size(1));
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight: contiguous [columns], x's dtype");
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(out.data_ptr<bf16>(), x.data_ptr<bf16>(), weight.data_ptr<bf16>(), x.size(0),
                  x.size(1), x.stride(0), out.stride(0), e);
  } else if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
                  x.size(0), x.size(1), x.stride(0), out.stride(0), e);
  } else {
    TORCH_CHECK(false, "rms_norm supports float32 and bfloat16, not ", x.scalar_type());
  }
}

// small_linear: rows [n0, n1) of w against the M rows of x, four of w's rows at a time
// (their sums independent, so the loads of the next overlap the multiply-adds).
// How far ahead of the rows being multiplied small_linear asks for w's rows into L2:
// the reference model's linears at one row, 2 threads, AVX-512 BF16, 58-64 us a call
// against 82-86 (4 to 32 rows ahead measured alike).
constexpr int64_t PREFETCH_ROWS_AHEAD = 8;

template <int M>
void small_linear_rows(bf16* out, const bf16* x, const bf16* w, const bf16* bias, int64_t k,
                       int64_t xs, int64_t os, int64_t n0, int64_t n1) {
  constexpr int64_t AT_ONCE = 4;
  for (int64_t n = n0; n < n1; n += AT_ONCE) {
    const int64_t count = std::min(AT_ONCE, n1 - n);
    float sums[AT_ONCE][M];
#ifdef KVSCOPE_AVX512_BF16
    if (k % 32 == 0) {
      __m512 acc[AT_ONCE][M];
      for (auto& row : acc)
        for (auto& a : row) a = _mm512_setzero_ps();
      const bf16* rows[AT_ONCE];  // past n1, repeat the last row; its sums are unused
      for (int64_t r = 0; r < AT_ONCE; ++r) rows[r] = w + std::min(n + r, n1 - 1) * k;
      if (n + PREFETCH_ROWS_AHEAD < n1) {  // the rows two steps on, into L2
        const char* next = reinterpret_cast<const char*>(w + (n + PREFETCH_ROWS_AHEAD) * k);
        const int64_t bytes = AT_ONCE * k * static_cast<int64_t>(sizeof(bf16));
        for (int64_t at = 0; at < bytes; at += 64) prefetch_l2(next + at);
      }
      for (int64_t d = 0; d < k; d += 32) {
        __m512bh xv[M];
        for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * xs + d);
        for (int64_t r = 0; r < AT_ONCE; ++r) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(rows[r] + d);
          for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv[m], wv);
        }
      }
      for (int64_t r = 0; r < count; ++r)
        for (int m = 0; m < M; ++m) sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);
    } else
#endif
    {
      for (int64_t r = 0; r < count; ++r)
        for (int m = 0; m < M; ++m) {
          float sum = 0;
          for (int64_t d = 0; d < k; ++d) sum += widen(x[m * xs + d]) * widen(w[(n + r) * k + d]);
          sums[r][m] = sum;
        }
    }
    for (int64_t r = 0; r < count; ++r)
      for (int m = 0; m < M; ++m) {
        const float b = bias != nullptr ? widen(bias[n + r]) : 0.0f;
        out[m * os + n + r] = bf16(sums[r][m] + b);
      }
  }
}

void small_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(rows >= 1 && rows <= 2, "small_linear: 1 or 2 rows");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "small_linear: bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == k,
              "small_linear: x [rows, k] with contiguous rows, weight contiguous [n, k]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == n && out.stride(1) == 1,
              "small_linear: out [rows, n] with contiguous rows");
  const bf16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->numel() == n,
                "small_linear: bias contiguous [n], bfloat16");
    b = bias->data_ptr<bf16>();
  }
  bf16* o = out.data_ptr<bf16>();
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  // Work items of 4 rows of w; 16 items (64 rows of w) at least a thread.
  at::parallel_for(0, (n + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * 4, n1 = std::min(n, end * 4);
    if (rows == 1)
      small_linear_rows<1>(o, xp, wp, b, k, xs, os, n0, n1);
    else
      small_linear_rows<2>(o, xp, wp, b, k, xs, os, n0, n1);
  });
}

}  // namespace

// The entry points ops.h declares, for the library's other files.
void kvscope_ops::rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                           double eps) {
  ::rms_norm(out, x, weight, eps);
}
void kvscope_ops::silu_and_mul(at::Tensor out, const at::Tensor& x) { ::silu_and_mul(out, x); }
void kvscope_ops::rope_and_cache(at::Tensor qk, const at::Tensor& v, const at::Tensor& cos,
                                 const at::Tensor& sin, const at::Tensor& slots,
                                 at::Tensor key_cache, at::Tensor value_cache) {
  ::rope_and_cache(qk, v, cos, sin, slots, key_cache, value_cache);
}
void kvscope_ops::small_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  ::small_linear(out, x, weight, bias);
}

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "rope_and_cache(Tensor(a!) qk, Tensor v, Tensor cos, Tensor sin, Tensor slots,"
      " Tensor(b!) key_cache, Tensor(c!) value_cache) -> ()");
  m.def("small_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_and_cache", &rope_and_cache);
  m.impl("small_linear", &small_linear);
}
