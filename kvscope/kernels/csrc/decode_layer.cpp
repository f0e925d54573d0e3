// decode_layer: one Llama-family decoder layer for a step of decode rows (one token per
// sequence), in one call from Python instead of ~15. At one stream of a small model the
// layer's kernels take ~0.15 ms and the Python between them as long again; here the
// same kernels run back to back (ops.h), in the order and with the roundings of
// `models/llama.py`'s forward, so the result is the same to the bit.
//
//   x = rms_norm(hidden); qkv = x Wqkv^T (+ bias); rope q, k and write k, v to the cache;
//   hidden += attend(q) Wo^T; hidden += down(silu(gate) * up)(rms_norm(hidden))
//
// A linear is a GGML-quantized weight (`qtype` names its block type: quant_linear) or,
// where `qtype` is empty, a bfloat16 weight for small_linear (1 or 2 rows).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "ops.h"

namespace {

void linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
            const std::string& qtype, const std::optional<at::Tensor>& bias) {
  if (qtype.empty()) {
    kvscope_ops::small_linear(out, x, weight, bias);
  } else {
    kvscope_ops::quant_linear(out, x, weight, qtype, x.size(1), bias);
  }
}

int64_t out_features(const at::Tensor& weight) { return weight.size(0); }

// weights: input_norm, qkv, o, post_norm, gate_up, down; qtypes: qkv, o, gate_up, down.
void decode_layer(at::Tensor hidden, const std::vector<at::Tensor>& weights,
                  const std::vector<std::string>& qtypes, const std::optional<at::Tensor>& qkv_bias,
                  const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                  at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, int64_t num_heads, double eps, double scale) {
  TORCH_CHECK(weights.size() == 6 && qtypes.size() == 4,
              "decode_layer: weights (input_norm, qkv, o, post_norm, gate_up, down) and "
              "their four qtypes");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layer: hidden [rows, dim]");
  const at::Tensor &input_norm = weights[0], &w_qkv = weights[1], &w_o = weights[2];
  const at::Tensor &post_norm = weights[3], &w_gate_up = weights[4], &w_down = weights[5];
  const int64_t rows = hidden.size(0), kv_heads = key_cache.size(2), dim = key_cache.size(3);
  const int64_t q_size = num_heads * dim, kv_size = kv_heads * dim;
  TORCH_CHECK(out_features(w_qkv) == q_size + 2 * kv_size,
              "decode_layer: qkv has ", out_features(w_qkv), " outputs; the heads need ",
              q_size + 2 * kv_size);
  const auto options = hidden.options();

  at::Tensor x = at::empty_like(hidden);
  kvscope_ops::rms_norm(x, hidden, input_norm, eps);
  at::Tensor qkv = at::empty({rows, q_size + 2 * kv_size}, options);
  linear(qkv, x, w_qkv, qtypes[0], qkv_bias);
  at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({rows, num_heads + kv_heads, dim});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, dim});
  kvscope_ops::rope_and_cache(qk, v, cos, sin, slots, key_cache, value_cache);
  at::Tensor attended = at::empty({rows, num_heads, dim}, options);
  kvscope_ops::paged_decode(attended, qk.narrow(1, 0, num_heads), key_cache, value_cache,
                            block_tables, context_lens, scale);
  at::Tensor projected = at::empty({rows, out_features(w_o)}, options);
  linear(projected, attended.view({rows, q_size}), w_o, qtypes[1], std::nullopt);
  hidden.add_(projected);

  kvscope_ops::rms_norm(x, hidden, post_norm, eps);
  const int64_t intermediate = out_features(w_gate_up) / 2;
  at::Tensor gate_up = at::empty({rows, 2 * intermediate}, options);
  linear(gate_up, x, w_gate_up, qtypes[2], std::nullopt);
  at::Tensor activated = at::empty({rows, intermediate}, options);
  kvscope_ops::silu_and_mul(activated, gate_up);
  at::Tensor down = at::empty_like(hidden);
  linear(down, activated, w_down, qtypes[3], std::nullopt);
  hidden.add_(down);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvscope, m) {
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor[] weights, str[] qtypes, Tensor? qkv_bias,"
      " Tensor cos, Tensor sin, Tensor slots, Tensor(b!) key_cache, Tensor(c!) value_cache,"
      " Tensor block_tables, Tensor context_lens, int num_heads, float eps, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvscope, CPU, m) { m.impl("decode_layer", &decode_layer); }
