// The decoder's elementwise steps fused, so that each is one pass over its rows instead
// of several whole-tensor passes (each a trip through memory for a prefill's rows):
//
//   silu_and_mul(out, x):       out = silu(x[:, :n]) * x[:, n:]   (the MLP's gate and up)
//   rms_norm(out, x, w, eps):   out = w * (x / sqrt(mean(x^2) + eps))
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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
}
