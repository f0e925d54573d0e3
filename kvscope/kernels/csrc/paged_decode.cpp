// Paged decode attention on the CPU, reading K/V from the paged cache in place.
//
// One query token per sequence attends over that sequence's blocks. The work items are
// (sequence, KV head, span of blocks) across at::parallel_for (torch's intra-op
// threads, so the model's thread setting holds). A sequence is cut into spans only when
// the (sequence, KV head) pairs are too few to give every thread two; each span is then
// at least MIN_SPAN_TOKENS long, and a second pass merges the spans' partial softmaxes.
// Each item loads its group of query heads (the heads sharing this KV head) once, then
// walks its blocks: scores for every head of the group against a block's keys, an
// online softmax in float32 (running max and sum per head, the accumulator rescaled
// when the max grows), and the block's values added in.
//
// The vector path (head size a multiple of the vector width) is written once over
// `simd::V`, which the build's -march=native makes 16 float lanes with AVX-512F or 8
// with AVX2 and FMA. It reads the cache directly (bfloat16 widened with a shift),
// reduces the dot products of 8 keys at once, takes exp() vectorised (a block of 16
// keys' softmax step in one vector), and lets up to 4 heads of a group share each value
// load (on the 2-core AMX machine: batch 32, context 160-320, one layer of the reference
// model's shape, 0.35 against 0.39 ms; the decode reads its blocks from memory at about
// 12 GB/s a core, which is most of its time; asking for blocks further ahead into L2,
// `L2_PREFETCH_BLOCKS_AHEAD`, took a third of that time off on the AVX-512 machine).
// With
// AVX-512 BF16 the bfloat16 query-key dot products use VDPBF16PS (32 pairs an
// instruction, float32 sums). Without any of these, keys and values are converted to
// float32 a block at a time and plain loops do the rest. `paged_decode_isa()` names
// the path the build took. float32 and bfloat16 caches.
//
// `paged_prefill` (further down) attends prefill chunks in place, a tile of a chunk's
// rows at a time; whether it serves is decided in kvscope/kernels/cpu_decode.py.
//
// The torch reference this is tested against: kvscope/kernels/attention.py,
// reference_decode.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>
#include "ops.h"

namespace {

using bf16 = c10::BFloat16;

// When the (sequence, KV head) pairs are fewer than two a thread, their blocks are
// shared out evenly instead, each thread's share at least this many blocks (a share
// costs a thread's start, ~2-3 us; a block of 16 keys under one KV head ~0.3 us).
constexpr int64_t MIN_SHARE_BLOCKS = 8;
// Besides the next block (into L1), the block this many ahead is asked for into L2: one
// block ahead is ~64 cache lines, more than the L1 can have in flight, so from DRAM the
// kernel waited on every block. Reference model, 2 threads, AVX-512 BF16, one layer of
// 32 rows at context 320: 0.47 ms against 0.76-0.91 (2 ahead 0.48, 4 0.51-0.52, 8 0.59);
// 8 rows at 1,000: 0.36 against 0.50; one row at 2,000: 0.14 against 0.19.
constexpr int64_t L2_PREFETCH_BLOCKS_AHEAD = 3;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, bf16* out) { *out = bf16(x); }

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



// What one work item needs: the query group, and scratch for one block.
struct Scratch {
  std::vector<float> qf;     // [group, dim], scaled, float32
  std::vector<float> rows;   // [block_size, dim], the scalar path's converted keys/values
  std::vector<float> scores; // [group, block_size]
  Scratch(int64_t group, int64_t dim, int64_t block_size)
      : qf(group * dim), rows(block_size * dim), scores(group * block_size) {}
};

template <typename T>
struct Problem {
  const T* q;
  const T* kc;
  const T* vc;
  const int64_t* tables;
  const int32_t* lens;
  int64_t heads, dim, block_size, kv_heads, group, max_blocks;
  int64_t qs0, qs1, ks0, ks1, ks2, vs0, vs1, vs2;
  float scale;

  bool vector_path() const {
#ifdef KVSCOPE_SIMD
    return dim % simd::W == 0;
#else
    return false;
#endif
  }

  // scores[g * block_size + t] for the n keys of one block (keys[t * ks1]), scaled.
  void block_scores(Scratch& w, const T* qraw, const T* keys, int64_t n,
                    float* scores) const {
#ifdef KVSCOPE_SIMD
    if (vector_path()) {
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
          const T* k[8];  // past the block's end, repeat its last key; its sum is unused
          for (int64_t i = 0; i < 8; ++i) k[i] = keys + std::min(t0 + i, n - 1) * ks1;
          float sums[8];
          if (!dot8_bf16(qraw + g * qs1, k, sums)) dot8(&w.qf[g * dim], k, sums);
          std::memcpy(&scores[g * block_size + t0], sums, sizeof(float) * std::min<int64_t>(8, n - t0));
        }
      }
      return;
    }
#endif
    (void)qraw;
    float* rows = w.rows.data();
    for (int64_t t = 0; t < n; ++t) load_row(keys + t * ks1, &rows[t * dim], dim);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t t = 0; t < n; ++t) scores[g * block_size + t] = dot(&w.qf[g * dim], &rows[t * dim], dim);
  }

#ifdef KVSCOPE_SIMD
  // The scaled float query against eight keys.
  void dot8(const float* qf, const T* const* k, float* sums) const {
    simd::V acc[8];
    for (auto& a : acc) a = simd::zero();
    for (int64_t d = 0; d < dim; d += simd::W) {
      const simd::V qv = simd::load(qf + d);
      for (int i = 0; i < 8; ++i) acc[i] = simd::fmadd(qv, simd::load(k[i] + d), acc[i]);
    }
    __m256 folded[8];
    for (int i = 0; i < 8; ++i) folded[i] = simd::fold(acc[i]);
    _mm256_storeu_ps(sums, simd::sum8(folded));
  }

  // The raw bfloat16 query against eight bfloat16 keys with VDPBF16PS; false where that
  // instruction or this dtype is not there.
  bool dot8_bf16(const T* qraw, const T* const* k, float* sums) const {
#ifdef KVSCOPE_AVX512_BF16
    if constexpr (std::is_same_v<T, bf16>) {
      if (dim % 32 != 0) return false;
      __m512 acc[8];
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qraw + d);
        for (int i = 0; i < 8; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(k[i] + d));
      }
      __m256 folded[8];
      for (int i = 0; i < 8; ++i) folded[i] = simd::fold(acc[i]);
      _mm256_storeu_ps(sums, _mm256_mul_ps(simd::sum8(folded), _mm256_set1_ps(scale)));
      return true;
    }
#endif
    (void)qraw, (void)k, (void)sums;
    return false;
  }
#endif

  // acc[g, :] += sum over t of p[g * block_size + t] * values[t * vs1, :].
  void block_values(Scratch& w, const T* values, int64_t n, const float* p, float* acc) const {
#ifdef KVSCOPE_SIMD
    if (vector_path()) {
      // Up to HEADS_AT_ONCE heads of the group share each value load (4 x 4 sums fit
      // AVX-512's registers, 2 x 4 AVX2's).
      constexpr int64_t HEADS_AT_ONCE = simd::W == 16 ? 4 : 2;
      for (int64_t g = 0; g < group; g += HEADS_AT_ONCE) {
        const float* pg = p + g * block_size;
        float* a = acc + g * dim;
        switch (std::min(HEADS_AT_ONCE, group - g)) {
          case 4: values_for_heads<4>(values, n, pg, a); break;
          case 3: values_for_heads<3>(values, n, pg, a); break;
          case 2: values_for_heads<2>(values, n, pg, a); break;
          default: values_for_heads<1>(values, n, pg, a); break;
        }
      }
      return;
    }
#endif
    for (int64_t t = 0; t < n; ++t) load_row(values + t * vs1, &w.rows[t * dim], dim);
    for (int64_t g = 0; g < group; ++g) {
      float* a = acc + g * dim;
      for (int64_t t = 0; t < n; ++t) {
        const float pt = p[g * block_size + t];
        const float* v = &w.rows[t * dim];
        for (int64_t d = 0; d < dim; ++d) a[d] += pt * v[d];
      }
    }
  }

#ifdef KVSCOPE_SIMD
  // block_values for G heads at once: p and acc start at the first of them.
  template <int G>
  void values_for_heads(const T* values, int64_t n, const float* p, float* acc) const {
    using namespace simd;
    int64_t d = 0;
    for (; d + 4 * W <= dim; d += 4 * W) {  // four independent chains a head
      V a[G][4];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g)
        for (int k = 0; k < 4; ++k) a[g][k] = load(acc + g * dim + d + k * W);
      for (int64_t t = 0; t < n; ++t) {
        const T* v = values + t * vs1 + d;
        const V v0 = load(v), v1 = load(v + W), v2 = load(v + 2 * W), v3 = load(v + 3 * W);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const V pt = set1(p[g * block_size + t]);
          a[g][0] = fmadd(pt, v0, a[g][0]);
          a[g][1] = fmadd(pt, v1, a[g][1]);
          a[g][2] = fmadd(pt, v2, a[g][2]);
          a[g][3] = fmadd(pt, v3, a[g][3]);
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g)
        for (int k = 0; k < 4; ++k) store(acc + g * dim + d + k * W, a[g][k]);
    }
    for (; d < dim; d += W) {
      V a[G];
      for (int g = 0; g < G; ++g) a[g] = load(acc + g * dim + d);
      for (int64_t t = 0; t < n; ++t) {
        const V v = load(values + t * vs1 + d);
        for (int g = 0; g < G; ++g) a[g] = fmadd(set1(p[g * block_size + t]), v, a[g]);
      }
      for (int g = 0; g < G; ++g) store(acc + g * dim + d, a[g]);
    }
  }
#endif

  // s[t] = exp(s[t] - m) for t < n.
  static void exp_shifted(float* s, int64_t n, float m) {
    int64_t t = 0;
#ifdef KVSCOPE_SIMD
    const simd::V mv = simd::set1(m);
    for (; t + simd::W <= n; t += simd::W) simd::store(s + t, simd::exp(simd::sub(simd::load(s + t), mv)));
#endif
    for (; t < n; ++t) s[t] = std::exp(s[t] - m);
  }

  // Asks for a block's keys and values ahead of their use: the blocks are scattered, so
  // the hardware prefetcher does not see them coming.
  void prefetch_block(int64_t block, int64_t h, bool far = false) const {
    prefetch_rows(kc + block * ks0 + h * ks2, ks1, far);
    prefetch_rows(vc + block * vs0 + h * vs2, vs1, far);
  }
  void prefetch_rows(const T* base, int64_t stride, bool far) const {
    const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
    for (int64_t t = 0; t < block_size; ++t) {
      const char* row = reinterpret_cast<const char*>(base + t * stride);
      for (int64_t at = 0; at < row_bytes; at += 64) far ? prefetch_l2(row + at) : prefetch(row + at);
    }
  }


  // Blocks [j_begin, j_end) of sequence b under KV head h: the unnormalised sums into
  // acc [group, dim], the running max and sum into run_max / run_sum [group].
  void attend(Scratch& w, int64_t b, int64_t h, int64_t j_begin, int64_t j_end, float* acc,
              float* run_max, float* run_sum) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const T* qraw = q + b * qs0 + h * group * qs1;
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < dim; ++d) w.qf[g * dim + d] = to_float(qraw[g * qs1 + d]) * scale;
    std::fill(acc, acc + group * dim, 0.0f);
    std::fill(run_max, run_max + group, neg_inf);
    std::fill(run_sum, run_sum + group, 0.0f);
    const int64_t len = lens[b];
    float* scores = w.scores.data();
    constexpr int64_t far = L2_PREFETCH_BLOCKS_AHEAD;
    for (int64_t j = j_begin + 2; j < std::min(j_begin + far, j_end); ++j)
      prefetch_block(tables[b * max_blocks + j], h, true);
    for (int64_t j = j_begin; j < j_end; ++j) {
      const int64_t block = tables[b * max_blocks + j];
      const int64_t n = std::min(block_size, len - j * block_size);
      if (j + 1 < j_end) prefetch_block(tables[b * max_blocks + j + 1], h);
      if (j + far < j_end) prefetch_block(tables[b * max_blocks + j + far], h, true);
      block_scores(w, qraw, kc + block * ks0 + h * ks2, n, scores);
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * block_size];
        float block_max = neg_inf;
#ifdef KVSCOPE_SIMD
        const bool one_vector = block_size == simd::W;  // the block's scores in one vector
        if (one_vector) block_max = simd::hmax(simd::below(n, simd::load(s), simd::set1(neg_inf)));
#else
        constexpr bool one_vector = false;
#endif
        if (!one_vector)
          for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
        const float new_max = std::max(run_max[g], block_max);
        if (new_max > run_max[g]) {
          const float correction = std::exp(run_max[g] - new_max);  // 0 on the first block
          run_sum[g] *= correction;
          float* a = &acc[g * dim];
          for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
          run_max[g] = new_max;
        }
#ifdef KVSCOPE_SIMD
        if (one_vector) {
          using namespace simd;
          const V p = below(n, exp(sub(load(s), set1(new_max))), zero());
          store(s, p);
          run_sum[g] += hsum(p);
          continue;
        }
#endif
        exp_shifted(s, n, new_max);
        float sum = 0;
        for (int64_t t = 0; t < n; ++t) sum += s[t];
        run_sum[g] += sum;
      }
      block_values(w, vc + block * vs0 + h * vs2, n, scores, acc);
    }
  }
};

template <typename T>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, double scale) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const Problem<T> pb{query.data_ptr<T>(),
                      key_cache.data_ptr<T>(),
                      value_cache.data_ptr<T>(),
                      block_tables.data_ptr<int64_t>(),
                      context_lens.data_ptr<int32_t>(),
                      heads,
                      dim,
                      block_size,
                      kv_heads,
                      heads / kv_heads,
                      block_tables.size(1),
                      query.stride(0),
                      query.stride(1),
                      key_cache.stride(0),
                      key_cache.stride(1),
                      key_cache.stride(2),
                      value_cache.stride(0),
                      value_cache.stride(1),
                      value_cache.stride(2),
                      static_cast<float>(scale)};
  const int64_t group = pb.group;
  T* o = out.data_ptr<T>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  auto write_out = [&](int64_t b, int64_t h, int64_t g, const float* acc, float inv) {
    T* dst = o + b * os0 + (h * group + g) * os1;
    for (int64_t d = 0; d < dim; ++d) from_float(acc[d] * inv, &dst[d]);
  };

  const int64_t pairs = batch * kv_heads, threads = at::get_num_threads();
  auto blocks_of = [&](int64_t pair) { return (pb.lens[pair / kv_heads] + block_size - 1) / block_size; };
  if (pairs >= 2 * threads) {  // every thread gets two (sequence, KV head) pairs or more
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      Scratch w(group, dim, block_size);
      std::vector<float> acc(group * dim), run_max(group), run_sum(group);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / kv_heads, h = item % kv_heads;
        pb.attend(w, b, h, 0, blocks_of(item), acc.data(), run_max.data(), run_sum.data());
        for (int64_t g = 0; g < group; ++g)
          write_out(b, h, g, &acc[g * dim], run_sum[g] > 0 ? 1.0f / run_sum[g] : 0.0f);
      }
    });
    return;
  }

  // Few pairs (a step of one or a few rows): all pairs' blocks in a row, cut into one
  // equal share a thread (no more shares than MIN_SHARE_BLOCKS each allows); a pair cut
  // between shares leaves partial softmaxes that the calling thread merges after.
  std::vector<int64_t> first_block(pairs + 1, 0);  // pair p's blocks: [first[p], first[p+1])
  for (int64_t p = 0; p < pairs; ++p) first_block[p + 1] = first_block[p] + blocks_of(p);
  const int64_t total = first_block[pairs];
  const int64_t shares = std::clamp<int64_t>(total / MIN_SHARE_BLOCKS, 1, threads);
  auto share_start = [&](int64_t s) { return total * s / shares; };
  // A cut pair's pieces: one partial result a share it meets (at most shares + pairs).
  struct Piece {
    int64_t pair, j_begin, j_end, slot;  // slot: where its partial goes; -1: not cut
  };
  std::vector<std::vector<Piece>> pieces(shares);
  std::vector<int64_t> cut_first(pairs, -1), cut_count(pairs, 0);
  int64_t slots = 0;
  for (int64_t s = 0; s < shares; ++s) {
    const int64_t lo = share_start(s), hi = share_start(s + 1);
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t b0 = std::max(lo, first_block[p]), b1 = std::min(hi, first_block[p + 1]);
      if (b0 >= b1) continue;
      const bool whole = b0 == first_block[p] && b1 == first_block[p + 1];
      int64_t slot = -1;
      if (!whole) {
        if (cut_first[p] < 0) cut_first[p] = slots;
        slot = slots++;
        ++cut_count[p];
      }
      pieces[s].push_back({p, b0 - first_block[p], b1 - first_block[p], slot});
    }
  }
  std::vector<float> part_acc(slots * group * dim), part_max(slots * group), part_sum(slots * group);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    Scratch w(group, dim, block_size);
    std::vector<float> acc(group * dim), run_max(group), run_sum(group);
    for (int64_t s = begin; s < end; ++s) {
      for (const Piece& piece : pieces[s]) {
        const int64_t b = piece.pair / kv_heads, h = piece.pair % kv_heads;
        if (piece.slot >= 0) {
          const int64_t at = piece.slot;
          pb.attend(w, b, h, piece.j_begin, piece.j_end, &part_acc[at * group * dim],
                    &part_max[at * group], &part_sum[at * group]);
          continue;
        }
        pb.attend(w, b, h, piece.j_begin, piece.j_end, acc.data(), run_max.data(), run_sum.data());
        for (int64_t g = 0; g < group; ++g)
          write_out(b, h, g, &acc[g * dim], run_sum[g] > 0 ? 1.0f / run_sum[g] : 0.0f);
      }
    }
  });
  // The cut pairs' partial softmaxes merged (a few heads' worth: not worth threads);
  // an empty sequence's heads are zeros.
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> acc(dim);
  for (int64_t p = 0; p < pairs; ++p) {
    if (first_block[p] == first_block[p + 1]) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < group; ++g) write_out(p / kv_heads, p % kv_heads, g, acc.data(), 0.0f);
    }
    if (cut_first[p] < 0) continue;
    for (int64_t g = 0; g < group; ++g) {
      float m = neg_inf;
      for (int64_t s = cut_first[p]; s < cut_first[p] + cut_count[p]; ++s)
        m = std::max(m, part_max[s * group + g]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float sum = 0;
      for (int64_t s = cut_first[p]; s < cut_first[p] + cut_count[p]; ++s) {
        const int64_t at = s * group + g;
        if (part_max[at] == neg_inf) continue;
        const float weight = std::exp(part_max[at] - m);
        sum += weight * part_sum[at];
        const float* a = &part_acc[at * dim];
        for (int64_t d = 0; d < dim; ++d) acc[d] += weight * a[d];
      }
      write_out(p / kv_heads, p % kv_heads, g, acc.data(), sum > 0 ? 1.0f / sum : 0.0f);
    }
  }
}

// What both ops ask of their tensors.
void check_shapes(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables) {
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
                  block_tables.dim() == 2,
              "block_tables: contiguous int64 [rows, max_blocks]");
}

// ---- Prefill: a chunk's rows attend together, a tile of rows at a time ----------
//
// The rows of one prefill chunk read the same blocks, each up to its own causal length
// (its position + 1). A work item is (chunk, KV head, tile of up to TILE_ROWS rows): it
// converts each block's keys once, transposed ([dim][keys], so one row's scores against
// the block are a vector: a multiply-add per dimension, no horizontal sums) and its
// values once to float32, and every row of the tile and head of the group uses them.
// The softmax is online, per row and head, as in the decode path.

constexpr int64_t TILE_ROWS = 32;

#ifdef KVSCOPE_SIMD
constexpr int64_t LANES = simd::W;
#else
constexpr int64_t LANES = 1;
#endif

// Row-heads (a tile row under one query head) computed together: independent
// multiply-add chains that share each load of a key or value vector.
constexpr int64_t ROW_HEADS = 8;

template <typename T>
struct PrefillTile {
  const Problem<T>& pb;
  int64_t padded;            // block_size rounded up to LANES
  int64_t slots;             // TILE_ROWS * group rounded up to ROW_HEADS
  std::vector<float> kt;     // [dim][padded] the block's keys, transposed, zero padded
  std::vector<float> vf;     // [padded][dim] its values (rows past the block's end: zero)
  std::vector<float> qf;     // [slots][dim] scaled queries (unused slots: zero)
  std::vector<float> acc;    // [slots][dim]
  std::vector<float> probs;  // [slots][padded] scores, then probabilities, of a block
  std::vector<float> run_max, run_sum, correction;
  std::vector<int64_t> valid;  // [slots] keys of the block each row-head sees

  explicit PrefillTile(const Problem<T>& problem)
      : pb(problem),
        padded((problem.block_size + LANES - 1) / LANES * LANES),
        slots((TILE_ROWS * problem.group + ROW_HEADS - 1) / ROW_HEADS * ROW_HEADS),
        kt(problem.dim * padded),
        vf(padded * problem.dim),
        qf(slots * problem.dim),
        acc(slots * problem.dim),
        probs(slots * padded),
        run_max(slots),
        run_sum(slots),
        correction(slots),
        valid(slots) {}

  // The block's first n keys and values of KV head h, converted.
  void load_block(int64_t block, int64_t h, int64_t n) {
    const int64_t dim = pb.dim;
    const T* keys = pb.kc + block * pb.ks0 + h * pb.ks2;
    const T* values = pb.vc + block * pb.vs0 + h * pb.vs2;
    for (int64_t t = 0; t < n; ++t) load_row(values + t * pb.vs1, &vf[t * dim], dim);
    std::fill(vf.begin() + n * dim, vf.end(), 0.0f);
    if (transpose_keys(keys, n)) return;
    for (int64_t t = 0; t < n; ++t) {
      const T* k = keys + t * pb.ks1;
      for (int64_t d = 0; d < dim; ++d) kt[d * padded + t] = to_float(k[d]);
    }
    for (int64_t d = 0; d < dim; ++d) std::fill(&kt[d * padded + n], &kt[(d + 1) * padded], 0.0f);
  }

  // kt from the block's keys with AVX-512 gathers (one 32-bit word of each of the 16
  // keys at a time: two bfloat16 dimensions or one float32); false where that path
  // does not apply and the scalar copy above does it.
  bool transpose_keys(const T* keys, int64_t n) {
#if defined(__AVX512F__)
    if (padded != 16 || pb.ks1 * static_cast<int64_t>(sizeof(T)) * 16 > (int64_t{1} << 30))
      return false;
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    const __m512i at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int>(pb.ks1 * sizeof(T))));
    const char* base = reinterpret_cast<const char*>(keys);
    if constexpr (std::is_same_v<T, bf16>) {
      if (pb.dim % 2 != 0) return false;
      for (int64_t d = 0; d < pb.dim; d += 2) {
        const __m512i pair = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at,
                                                         base + d * sizeof(T), 1);
        _mm512_storeu_ps(&kt[d * 16], _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
        _mm512_storeu_ps(&kt[(d + 1) * 16], _mm512_castsi512_ps(_mm512_and_si512(
                                                pair, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
      }
    } else {
      for (int64_t d = 0; d < pb.dim; ++d)
        _mm512_storeu_ps(&kt[d * 16], _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at,
                                                               base + d * sizeof(T), 1));
    }
    return true;
#else
    (void)keys, (void)n;
    return false;
#endif
  }

  // probs[s, :] = qf[s] . keys, for the ROW_HEADS slots from s0.
  void scores(int64_t s0) {
    const int64_t dim = pb.dim;
    const float* q = &qf[s0 * dim];
    float* out = &probs[s0 * padded];
#ifdef KVSCOPE_SIMD
    using namespace simd;
    for (int64_t t = 0; t < padded; t += W) {
      V a[ROW_HEADS];
      for (auto& x : a) x = zero();
      for (int64_t d = 0; d < dim; ++d) {
        const V k = load(&kt[d * padded + t]);
#pragma GCC unroll 8
        for (int64_t r = 0; r < ROW_HEADS; ++r) a[r] = fmadd(set1(q[r * dim + d]), k, a[r]);
      }
      for (int64_t r = 0; r < ROW_HEADS; ++r) store(&out[r * padded + t], a[r]);
    }
#else
    std::fill(out, out + ROW_HEADS * padded, 0.0f);
    for (int64_t r = 0; r < ROW_HEADS; ++r)
      for (int64_t d = 0; d < dim; ++d)
        for (int64_t t = 0; t < padded; ++t) out[r * padded + t] += q[r * dim + d] * kt[d * padded + t];
#endif
  }

  // One slot's online softmax step: its scores become probabilities (0 past `valid`),
  // and `correction` is what its earlier sums are scaled by.
  void softmax(int64_t slot) {
    float* s = &probs[slot * padded];
    const int64_t n = valid[slot];
    if (n <= 0) {  // this row's causal length ends before the block
      std::fill(s, s + padded, 0.0f);
      correction[slot] = 1.0f;
      return;
    }
    const float neg_inf = -std::numeric_limits<float>::infinity();
#ifdef KVSCOPE_SIMD
    if (padded == simd::W) {  // the block in one vector
      using namespace simd;
      const V scores = below(n, load(s), set1(neg_inf));
      const float new_max = std::max(run_max[slot], hmax(scores));
      correction[slot] = std::exp(run_max[slot] - new_max);
      run_max[slot] = new_max;
      const V p = below(n, exp(sub(scores, set1(new_max))), zero());
      store(s, p);
      run_sum[slot] = run_sum[slot] * correction[slot] + hsum(p);
      return;
    }
#endif
    float block_max = neg_inf;
    for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
    const float new_max = std::max(run_max[slot], block_max);
    correction[slot] = std::exp(run_max[slot] - new_max);  // 0 on the first block
    run_max[slot] = new_max;
    Problem<T>::exp_shifted(s, n, new_max);
    std::fill(s + n, s + padded, 0.0f);
    float sum = 0;
    for (int64_t t = 0; t < n; ++t) sum += s[t];
    run_sum[slot] = run_sum[slot] * correction[slot] + sum;
  }

  // acc[s] = acc[s] * correction[s] + probs[s] . values, for the ROW_HEADS slots from s0.
  void add_values(int64_t s0) {
    const int64_t dim = pb.dim;
    const float* p = &probs[s0 * padded];
    float* out = &acc[s0 * dim];
#ifdef KVSCOPE_SIMD
    if (dim % simd::W == 0) {
      using namespace simd;
      for (int64_t d = 0; d < dim; d += W) {
        V a[ROW_HEADS];
#pragma GCC unroll 8
        for (int64_t r = 0; r < ROW_HEADS; ++r)
          a[r] = mul(load(&out[r * dim + d]), set1(correction[s0 + r]));
        for (int64_t t = 0; t < padded; ++t) {
          const V v = load(&vf[t * dim + d]);
#pragma GCC unroll 8
          for (int64_t r = 0; r < ROW_HEADS; ++r) a[r] = fmadd(set1(p[r * padded + t]), v, a[r]);
        }
        for (int64_t r = 0; r < ROW_HEADS; ++r) store(&out[r * dim + d], a[r]);
      }
      return;
    }
#endif
    for (int64_t r = 0; r < ROW_HEADS; ++r) {
      float* a = &out[r * dim];
      for (int64_t d = 0; d < dim; ++d) a[d] *= correction[s0 + r];
      for (int64_t t = 0; t < padded; ++t)
        for (int64_t d = 0; d < dim; ++d) a[d] += p[r * padded + t] * vf[t * dim + d];
    }
  }

  // Rows [i0, i1) of a chunk whose first row is `row0` in the query and whose first
  // token sits at position `start`, under KV head h, with blocks `table`.
  void attend(const int64_t* table, int64_t row0, int64_t start, int64_t i0, int64_t i1,
              int64_t h, T* o, int64_t os0, int64_t os1) {
    const int64_t dim = pb.dim, group = pb.group, bs = pb.block_size;
    const int64_t used = (i1 - i0) * group;  // slot r * group + g: row i0 + r, head g
    std::fill(qf.begin(), qf.end(), 0.0f);
    for (int64_t slot = 0; slot < used; ++slot) {
      const int64_t r = slot / group, g = slot % group;
      const T* src = pb.q + (row0 + i0 + r) * pb.qs0 + (h * group + g) * pb.qs1;
      for (int64_t d = 0; d < dim; ++d) qf[slot * dim + d] = to_float(src[d]) * pb.scale;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(run_sum.begin(), run_sum.end(), 0.0f);
    const int64_t longest = start + i1;  // the tile's last row attends this many tokens
    const int64_t num_blocks = (longest + bs - 1) / bs;
    const int64_t batches = (used + ROW_HEADS - 1) / ROW_HEADS;
    for (int64_t j = 0; j < num_blocks; ++j) {
      if (j + 1 < num_blocks) pb.prefetch_block(table[j + 1], h);
      const int64_t n = std::min(bs, longest - j * bs);
      load_block(table[j], h, n);
      for (int64_t slot = 0; slot < batches * ROW_HEADS; ++slot)
        valid[slot] = slot < used ? std::min(n, start + i0 + slot / group + 1 - j * bs) : 0;
      for (int64_t batch = 0; batch < batches; ++batch) {
        const int64_t s0 = batch * ROW_HEADS;
        if (*std::max_element(&valid[s0], &valid[s0] + ROW_HEADS) <= 0) continue;  // all ended
        scores(s0);
        for (int64_t slot = s0; slot < s0 + ROW_HEADS; ++slot) softmax(slot);
        add_values(s0);
      }
    }
    for (int64_t slot = 0; slot < used; ++slot) {
      const int64_t r = slot / group, g = slot % group;
      const float inv = run_sum[slot] > 0 ? 1.0f / run_sum[slot] : 0.0f;
      T* dst = o + (row0 + i0 + r) * os0 + (h * group + g) * os1;
      for (int64_t d = 0; d < dim; ++d) from_float(acc[slot * dim + d] * inv, &dst[d]);
    }
  }
};

template <typename T>
void prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
             const at::Tensor& value_cache, const at::Tensor& block_tables,
             const at::Tensor& starts, const at::Tensor& offsets, double scale) {
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t chunks = block_tables.size(0), max_blocks = block_tables.size(1);
  const Problem<T> pb{query.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                      block_tables.data_ptr<int64_t>(), nullptr, heads, dim, block_size,
                      kv_heads, heads / kv_heads, max_blocks, query.stride(0), query.stride(1),
                      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                      value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                      static_cast<float>(scale)};
  const int32_t* start = starts.data_ptr<int32_t>();
  const int32_t* offset = offsets.data_ptr<int32_t>();
  // Items (chunk, head, tile); a chunk's tiles longest and shortest by turns, so that
  // the threads' contiguous shares of the items cost about the same.
  struct Item {
    int64_t chunk, head, tile;
  };
  std::vector<Item> items;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t tiles = (offset[c + 1] - offset[c] + TILE_ROWS - 1) / TILE_ROWS;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t k = 0; k < tiles; ++k)
        items.push_back({c, h, k % 2 == 0 ? tiles - 1 - k / 2 : k / 2});
  }
  T* o = out.data_ptr<T>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    PrefillTile<T> tile(pb);
    for (int64_t at = begin; at < end; ++at) {
      const Item& item = items[at];
      const int64_t rows = offset[item.chunk + 1] - offset[item.chunk];
      const int64_t i0 = item.tile * TILE_ROWS, i1 = std::min(i0 + TILE_ROWS, rows);
      tile.attend(pb.tables + item.chunk * max_blocks, offset[item.chunk], start[item.chunk], i0,
                  i1, item.head, o, os0, os1);
    }
  });
}

void paged_prefill(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                   const at::Tensor& starts, const at::Tensor& offsets, double scale) {
  check_shapes(out, query, key_cache, value_cache, block_tables);
  TORCH_CHECK(starts.scalar_type() == at::kInt && starts.is_contiguous() &&
                  starts.numel() == block_tables.size(0),
              "starts: contiguous int32 [chunks]");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.is_contiguous() &&
                  offsets.numel() == block_tables.size(0) + 1,
              "offsets: contiguous int32 [chunks + 1]");
  const int32_t* offset = offsets.data_ptr<int32_t>();
  const int32_t* start = starts.data_ptr<int32_t>();
  const int64_t chunks = block_tables.size(0), block_size = key_cache.size(1);
  TORCH_CHECK(offset[0] == 0 && offset[chunks] == query.size(0), "offsets must span the query");
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(offset[c + 1] >= offset[c] && start[c] >= 0, "offsets ascend, starts >= 0");
    TORCH_CHECK(start[c] + offset[c + 1] - offset[c] <= block_tables.size(1) * block_size,
                "a chunk reaches past its block table");
  }
  if (query.scalar_type() == at::kFloat) {
    prefill<float>(out, query, key_cache, value_cache, block_tables, starts, offsets, scale);
  } else if (query.scalar_type() == at::kBFloat16) {
    prefill<bf16>(out, query, key_cache, value_cache, block_tables, starts, offsets, scale);
  } else {
    TORCH_CHECK(false, "paged_prefill supports float32 and bfloat16, not ", query.scalar_type());
  }
}

void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, double scale) {
  check_shapes(out, query, key_cache, value_cache, block_tables);
  TORCH_CHECK(block_tables.size(0) == query.size(0), "block_tables: one row per query row");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == query.size(0),
              "context_lens: contiguous int32 [batch]");
  if (query.scalar_type() == at::kFloat) {
    decode<float>(out, query, key_cache, value_cache, block_tables, context_lens, scale);
  } else if (query.scalar_type() == at::kBFloat16) {
    decode<bf16>(out, query, key_cache, value_cache, block_tables, context_lens, scale);
  } else {
    TORCH_CHECK(false, "paged_decode supports float32 and bfloat16, not ", query.scalar_type());
  }
}

// The instruction set the vector path was built for.
std::string paged_decode_isa() {
#if defined(KVSCOPE_AVX512_BF16)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(KVSCOPE_SIMD)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

// The entry points ops.h declares, for the library's other files.
void kvscope_ops::paged_decode(at::Tensor out, const at::Tensor& query,
                               const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& context_lens,
                               double scale) {
  ::paged_decode(out, query, key_cache, value_cache, block_tables, context_lens, scale);
}

TORCH_LIBRARY(kvscope, m) {
  m.def(
      "paged_decode(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, float scale) -> ()");
  m.def(
      "paged_prefill(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor starts, Tensor offsets, float scale) -> ()");
  m.def("paged_decode_isa() -> str", &paged_decode_isa);
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
}
