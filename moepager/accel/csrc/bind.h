// What the torch bindings (moe.cpp, step.cpp) share: the operators' namespace, a tensor's bf16 data, and the named
// expert format every MoE operator takes.
//
// The kernels are torch.library operators and classes in a namespace of the tier's own (TORCH_EXTENSION_NAME, e.g.
// `moepager_cpu_avx2`: torch.ops.moepager_cpu_avx2.moe_resident), so every tier's build can be loaded in one process
// (the tests compare them). The classes (step.cpp) live in a C++ namespace of that name too: torch keys its registry
// of custom classes by C++ type, and two tiers' classes must not share one.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/types.h>

#include <stdexcept>
#include <vector>

#include "rows.h"

// TORCH_LIBRARY pastes its namespace argument as written: this expands TORCH_EXTENSION_NAME first.
#define MOEPAGER_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
// An operator on tensors has a CPU kernel only (`m.def(schema, MOEPAGER_CPU(fn))`): its fake kernel for torch.compile
// is registered from Python (accel/ops.py).
#define MOEPAGER_CPU(fn) torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(fn))

// An expert format, in every schema that takes one: keyword-only arguments named as accel/ops.py's `FormatSpec` fields
// (Python passes them by name: a field missing, misnamed or of the wrong type is the dispatcher's error), then the
// C++ function's parameters in the same order, and the checked `Spec` they make.
#define MOEPAGER_FORMAT_SCHEMA \
  "*, int fmt, int hidden, int intermediate, int group, int gate_up, int down, int gate_up_scales, int down_scales"
#define MOEPAGER_FORMAT_PARAMS                                                                                     \
  int64_t fmt, int64_t hidden, int64_t intermediate, int64_t group, int64_t gate_up, int64_t down,                  \
      int64_t gate_up_scales, int64_t down_scales
#define MOEPAGER_FORMAT_SPEC spec_of(fmt, hidden, intermediate, group, gate_up, down, gate_up_scales, down_scales)

namespace {

inline const uint16_t* bf16_data(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// The kernels' Spec of a format's fields, checked (a format they do not know, a bad size or int4 group: an error).
inline Spec spec_of(MOEPAGER_FORMAT_PARAMS) {
  try {
    return checked({fmt, hidden, intermediate, group, gate_up, down, gate_up_scales, down_scales});
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace
