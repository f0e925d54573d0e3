// Paged decode attention on the CPU, reading K/V from the paged cache in place.
//
// One query token per sequence attends over that sequence's blocks. Work is split over
// (sequence, KV head) pairs with at::parallel_for (torch's intra-op threads, so the
// model's thread setting holds). Each pair loads its group of query heads (the heads
// that share this KV head) once, then walks the blocks: scores for every head of the
// group against a block's keys, an online softmax in float32 (running max and sum per
// head, the accumulator rescaled when the max grows), and the block's values added in.
// With AVX2 and FMA (and a head size that is a multiple of 8) the dot products and the
// value sums read the cache directly, 8 lanes at a time, widening bfloat16 with a shift;
// otherwise keys and values are converted to float32 a block at a time and plain loops
// do the rest (vectorised by the compiler where it can). float32 and bfloat16 caches.
//
// The torch reference this is tested against: kvscope/kernels/attention.py,
// reference_decode.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSCOPE_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, c10::BFloat16* out) { *out = c10::BFloat16(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(src[d]);
}

// Eight partial sums so the loop vectorises without reassociating float math.
inline float dot(const float* a, const float* b, int64_t dim) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8)
    for (int i = 0; i < 8; ++i) lanes[i] += a[d + i] * b[d + i];
  float sum = 0;
  for (; d < dim; ++d) sum += a[d] * b[d];
  for (int i = 0; i < 8; ++i) sum += lanes[i];
  return sum;
}

#ifdef KVSCOPE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

// Scores of the `group` query heads (qf: [group, dim], scaled) against the `n` keys of
// one block, into s[g * stride + t]. Returns false when the vector path does not apply.
template <typename T>
inline bool block_scores_fast(const float* qf, const T* keys, int64_t key_stride, int64_t n,
                              int64_t group, int64_t dim, float* s, int64_t stride) {
#ifdef KVSCOPE_AVX2
  if (dim % 8 != 0) return false;
  for (int64_t t = 0; t < n; ++t) {
    const T* k = keys + t * key_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float* q = qf + g * dim;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= dim; d += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), acc1);
      }
      if (d < dim) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc0);
      s[g * stride + t] = hsum(_mm256_add_ps(acc0, acc1));
    }
  }
  return true;
#else
  return false;
#endif
}

// acc[g, :] += sum over t of p[g * stride + t] * values[t, :]. False: not applicable.
template <typename T>
inline bool block_values_fast(const float* p, const T* values, int64_t value_stride, int64_t n,
                              int64_t group, int64_t dim, float* acc, int64_t stride) {
#ifdef KVSCOPE_AVX2
  if (dim % 8 != 0) return false;
  for (int64_t t = 0; t < n; ++t) {
    const T* v = values + t * value_stride;
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 vv = load8(v + d);
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + g * dim + d;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(p[g * stride + t]), vv,
                                            _mm256_loadu_ps(a)));
      }
    }
  }
  return true;
#else
  return false;
#endif
}

template <typename T>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, double scale) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks2 = key_cache.stride(2);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1),
                vs2 = value_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), rows(block_size * dim);
    std::vector<float> scores(group * block_size), run_max(group), run_sum(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[b];
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q + b * qs0 + (h * group + g) * qs1;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(src[d]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(run_max.begin(), run_max.end(), neg_inf);
      std::fill(run_sum.begin(), run_sum.end(), 0.0f);
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      for (int64_t j = 0; j < num_blocks; ++j) {
        const int64_t block = tables[b * max_blocks + j];
        const int64_t n = std::min(block_size, len - j * block_size);
        const T* keys = kc + block * ks0 + h * ks2;
        if (!block_scores_fast(qf.data(), keys, ks1, n, group, dim, scores.data(), block_size)) {
          for (int64_t t = 0; t < n; ++t) load_row(keys + t * ks1, &rows[t * dim], dim);
          for (int64_t g = 0; g < group; ++g)
            for (int64_t t = 0; t < n; ++t)
              scores[g * block_size + t] = dot(&qf[g * dim], &rows[t * dim], dim);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = &scores[g * block_size];
          float block_max = neg_inf;
          for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
          const float new_max = std::max(run_max[g], block_max);
          if (new_max > run_max[g]) {
            const float correction = std::exp(run_max[g] - new_max);  // 0 on the first block
            run_sum[g] *= correction;
            float* a = &acc[g * dim];
            for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
            run_max[g] = new_max;
          }
          float sum = 0;
          for (int64_t t = 0; t < n; ++t) {
            s[t] = std::exp(s[t] - new_max);
            sum += s[t];
          }
          run_sum[g] += sum;
        }
        const T* values = vc + block * vs0 + h * vs2;
        if (block_values_fast(scores.data(), values, vs1, n, group, dim, acc.data(), block_size))
          continue;
        for (int64_t t = 0; t < n; ++t) load_row(values + t * vs1, &rows[t * dim], dim);
        for (int64_t g = 0; g < group; ++g) {
          float* a = &acc[g * dim];
          const float* s = &scores[g * block_size];
          for (int64_t t = 0; t < n; ++t) {
            const float p = s[t];
            const float* v = &rows[t * dim];
            for (int64_t d = 0; d < dim; ++d) a[d] += p * v[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = o + b * os0 + (h * group + g) * os1;
        const float inv = run_sum[g] > 0 ? 1.0f / run_sum[g] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) from_float(acc[g * dim + d] * inv, &dst[d]);
      }
    }
  });
}

void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out: [batch, heads, dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "caches: [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim differs between query and cache");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  query.scalar_type() == value_cache.scalar_type() &&
                  query.scalar_type() == out.scalar_type(),
              "query, out and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == query.size(0),
              "block_tables: contiguous int64 [batch, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == query.size(0),
              "context_lens: contiguous int32 [batch]");
  if (query.scalar_type() == at::kFloat) {
    decode<float>(out, query, key_cache, value_cache, block_tables, context_lens, scale);
  } else if (query.scalar_type() == at::kBFloat16) {
    decode<c10::BFloat16>(out, query, key_cache, value_cache, block_tables, context_lens, scale);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16, not ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(kvscope, m) {
  m.def(
      "paged_decode(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) { m.impl("paged_decode", &paged_decode); }
