// What the torch bindings (moe.cpp, step.cpp) share: a tensor's bf16 data, and the core's errors as torch's.
#pragma once

#include <torch/extension.h>

#include <stdexcept>
#include <vector>

#include "rows.h"

namespace {

inline const uint16_t* bf16_data(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// An expert format's spec, a bad one raised as RuntimeError (TORCH_CHECK's error) like every other argument check.
inline Spec checked_spec(const std::vector<int64_t>& spec) {
  try {
    return parse_spec(spec);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace
