// What the torch bindings (moe.cpp, step.cpp) share: a tensor's bf16 data, and the core's errors as torch's.
#pragma once

#include <torch/extension.h>

#include <stdexcept>
#include <vector>

#include "rows.h"

namespace {

inline const uint16_t* bf16_data(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// An expert format from its Python value (accel/cpu_kernels.py `FormatSpec`), field by field by name; a bad one raised
// as RuntimeError (TORCH_CHECK's error) like every other argument check.
inline Spec spec_of(const pybind11::handle& spec) {
  const auto field = [&](const char* name) { return spec.attr(name).cast<int64_t>(); };
  try {
    return checked({field("fmt"), field("hidden"), field("intermediate"), field("group"), field("gate_up"),
                    field("down"), field("gate_up_scales"), field("down_scales")});
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace
