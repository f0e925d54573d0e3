// The compiled library's entry points that other translation units of the library call
// directly (decode_layer.cpp runs a whole decoder layer through them without going back
// to Python). Each is defined beside its kernel and checks its own arguments.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace kvscope_ops {

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void rope_and_cache(at::Tensor qk, const at::Tensor& v, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& slots, at::Tensor key_cache,
                    at::Tensor value_cache);
void small_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias);
void quant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& data,
                  const std::string& qtype, int64_t k, const std::optional<at::Tensor>& bias);
void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, double scale);

}  // namespace kvscope_ops
