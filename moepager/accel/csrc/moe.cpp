// moepager's CPU expert kernels bound to torch: one call per MoE layer (gate+up, SiLU, down, routing-weighted sum) for
// a few tokens, reading the weights at the memory-bandwidth limit, and the dense GEMV. The arithmetic is torch-free
// (experts.h, rows.h over simd.h); this file checks the tensors and hands their data to it. Built once per CPU tier by
// accel/cpu_kernels.py (one module per tier, compiled with that tier's target flags).
//
// Order of arithmetic (fixed, whatever the thread count or tier): each output element is one dot product (rows.h); a
// pair's (token, k) expert output is scaled by its routing weight in fp32 (y rows); a token's output sums its y rows
// in sorted (ascending expert id) order in fp32 and is rounded to bf16 once. `moe_partial` + `moe_combine` (paged
// layers, computed as experts land) and `moe_resident` (one call) run the same code, so they agree bit for bit.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "bind.h"
#include "experts.h"

namespace {

void check_x(const torch::Tensor& x, const Spec& s) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.size(1) == s.D,
              "x must be contiguous bf16 [N, ", s.D, "]");
}

// The arena's rows as bytes: its base and row stride, rows base..base + count checked to exist.
std::pair<const uint8_t*, int64_t> arena_rows(const torch::Tensor& arena, int64_t base, int64_t count) {
  TORCH_CHECK(arena.dim() == 2 && arena.stride(1) == 1 && base >= 0 && base + count <= arena.size(0),
              "the arena must be [rows, numel] with contiguous rows, rows base..base + num_experts in range");
  return {static_cast<const uint8_t*>(arena.data_ptr()), arena.stride(0) * arena.element_size()};
}

std::vector<Group> groups_of(const torch::Tensor& arena, const torch::Tensor& rows, const torch::Tensor& spans) {
  const auto [base, stride] = arena_rows(arena, 0, arena.size(0));
  auto r = rows.contiguous();
  auto sp = spans.contiguous();
  TORCH_CHECK(r.scalar_type() == torch::kLong && sp.scalar_type() == torch::kLong && sp.dim() == 2 &&
              sp.size(0) == r.size(0) && sp.size(1) == 2, "rows [G] and spans [G, 2] must be int64");
  std::vector<Group> groups;
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* spp = sp.data_ptr<int64_t>();
  for (int64_t g = 0; g < r.size(0); ++g) {
    TORCH_CHECK(rp[g] >= 0 && rp[g] < arena.size(0), "arena row ", rp[g], " out of range");
    groups.push_back({base + rp[g] * stride, spp[2 * g], spp[2 * g + 1]});
  }
  return groups;
}

}  // namespace

// The y rows of the given groups of sorted pairs (paged layers compute the experts that have landed).
void moe_partial(const torch::Tensor& x, const torch::Tensor& arena, const torch::Tensor& token,
                 const torch::Tensor& weight, const torch::Tensor& rows, const torch::Tensor& spans, torch::Tensor& y,
                 MOEPAGER_FORMAT_PARAMS) {
  const Spec s = MOEPAGER_FORMAT_SPEC;
  check_x(x, s);
  TORCH_CHECK(token.scalar_type() == torch::kLong && token.is_contiguous() && weight.scalar_type() == torch::kFloat &&
              weight.is_contiguous() && token.numel() == weight.numel(), "token [M] int64 and weight [M] fp32");
  TORCH_CHECK(y.scalar_type() == torch::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == token.numel() &&
              y.size(1) == s.D, "y must be contiguous fp32 [M, D]");
  auto groups = groups_of(arena, rows, spans);
  for (const auto& g : groups) TORCH_CHECK(g.begin >= 0 && g.end <= token.numel() && g.begin <= g.end, "bad span");
  const int64_t* tp = token.data_ptr<int64_t>();
  for (int64_t m = 0; m < token.numel(); ++m) TORCH_CHECK(tp[m] >= 0 && tp[m] < x.size(0), "token index out of range");
  run_layer(s, bf16_data(x), x.size(0), groups, tp, weight.data_ptr<float>(), y.data_ptr<float>(), nullptr);
}

// Each token's output: the sum of its y rows in sorted order, rounded to bf16 once (what moe_resident computes).
torch::Tensor moe_combine(const torch::Tensor& y, const torch::Tensor& token, int64_t n) {
  TORCH_CHECK(y.scalar_type() == torch::kFloat && y.is_contiguous() && y.dim() == 2 && token.is_contiguous() &&
              token.scalar_type() == torch::kLong && token.numel() == y.size(0), "y [M, D] fp32 and token [M] int64");
  const int64_t D = y.size(1), M = y.size(0);
  const int64_t* tp = token.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) TORCH_CHECK(tp[m] >= 0 && tp[m] < n, "token index out of range");
  auto out = torch::empty({n, D}, y.options().dtype(torch::kBFloat16));
  const float* yp = y.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t tiles = (D + TILE_D - 1) / TILE_D;
  parallel_for(0, tiles, grain_for(tiles, M * D * 16), [&](int64_t a, int64_t b) {  // (M * D adds: as ~16 MACs)
    std::vector<float> acc;
    for (int64_t task = a; task < b; ++task)
      combine_tile(yp, tp, M, n, D, task * TILE_D, std::min(D, task * TILE_D + TILE_D), op, acc);
  });
  return out;
}

// One resident layer in one call: experts e at arena rows base + e; the (token, k) pairs sorted by expert
// (stable) here, their outputs weighted and summed per token.
torch::Tensor moe_resident(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                           const torch::Tensor& arena, int64_t base, int64_t num_experts,
                           MOEPAGER_FORMAT_PARAMS) {
  const Spec s = MOEPAGER_FORMAT_SPEC;
  check_x(x, s);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && weights.sizes() == ids.sizes(), "ids and weights [N, K]");
  auto id = ids.to(torch::kLong).contiguous();
  auto w = weights.to(torch::kFloat).contiguous();
  const int64_t N = ids.size(0), K = ids.size(1), M = N * K;
  const int64_t* ip = id.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < num_experts, "expert id ", ip[i], " out of range");
  const auto [abase, stride] = arena_rows(arena, base, num_experts);
  SortedPairs pairs;
  pairs.sort(ip, w.data_ptr<float>(), N, K, num_experts, abase, stride, base);
  auto out = torch::empty({N, s.D}, x.options());
  std::vector<float> y(M * s.D);
  run_layer(s, bf16_data(x), N, pairs.groups, pairs.token.data(), pairs.weight.data(), y.data(),
            reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

namespace {

// y = x W^T (bf16 out) for bf16 x [T, K] against the N rows of `p` in format `fmt` (bf16, or int8 with the inputs
// quantized first), 16 rows a task.
torch::Tensor gemv(int64_t fmt, const Projection& p, const torch::Tensor& x) {
  auto xc = x.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1), N = p.N;
  auto yf = torch::empty({T, N}, x.options().dtype(torch::kFloat));
  auto out = torch::empty({T, N}, x.options());
  const auto* xp = bf16_data(xc);
  float* yp = yf.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<const uint16_t*> xs(T);
  std::vector<QRow> xr(T);
  QBuffer xq;
  if (fmt == BF16) {
    for (int64_t t = 0; t < T; ++t) xs[t] = xp + t * K;
  } else {
    xq.resize(T, K, fmt);
    quantize_rows(xp, K, fmt, xq, 0, T);
    for (int64_t t = 0; t < T; ++t) xr[t] = xq.row(t);
  }
  gemv_all(fmt, p, fmt == BF16 ? xs.data() : nullptr, fmt == BF16 ? nullptr : xr.data(), T, yp, op);
  return out;
}

}  // namespace

// y = x W^T for bf16 x [T, K] and W [N, K] (dense projections on a few tokens).
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
              w.dim() == 2 && x.size(1) == w.size(1) && w.is_contiguous(), "bf16 x [T, K] and contiguous W [N, K]");
  return gemv(BF16, {static_cast<const uint8_t*>(w.data_ptr()), nullptr, w.size(0), w.size(1)}, x);
}

// y = x (q * scale)^T for bf16 x [T, K], int8 q [N, K] and bf16 scales [N], the activations quantized to 8 bits in
// blocks of 32 (the int8 experts' arithmetic): `--dense-dtype int8-a8` projections.
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && q.scalar_type() == torch::kChar && q.is_contiguous() &&
              scale.scalar_type() == torch::kBFloat16 && scale.is_contiguous() && x.dim() == 2 && q.dim() == 2 &&
              x.size(1) == q.size(1) && scale.numel() == q.size(0), "bf16 x [T, K], int8 q [N, K], bf16 scale [N]");
  return gemv(INT8, {static_cast<const uint8_t*>(q.data_ptr()), bf16_data(scale), q.size(0), q.size(1)}, x);
}

// Reads every byte of `x` once, threads splitting it (the compiler vectorizes the sum at the tier's width): the
// machine's streaming read bandwidth, the limit the kernels above are measured against (benchmarks/cpu_kernels.py).
int64_t stream_read(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.nbytes() % 64 == 0, "a contiguous tensor of a multiple of 64 bytes");
  const auto* p = static_cast<const uint64_t*>(x.data_ptr());
  const int64_t words = x.nbytes() / 8, per = 1 << 17;
  std::vector<int64_t> part((words + per - 1) / per, 0);
  parallel_for(0, static_cast<int64_t>(part.size()), 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      uint64_t s[8] = {0};
      const int64_t w0 = i * per, w1 = std::min(words, w0 + per);
      for (int64_t w = w0; w < w1; w += 8)
        for (int j = 0; j < 8; ++j) s[j] += p[w + j];
      uint64_t total = 0;
      for (uint64_t v : s) total += v;
      part[i] = static_cast<int64_t>(total);
    }
  });
  int64_t total = 0;
  for (int64_t v : part) total += v;
  return total;
}

// One of every kind of arithmetic on fixed inputs, on the stack: accel/cpu_kernels.py runs it in a forked child before
// it trusts a build on this CPU (an instruction the CPU lacks kills the child, not the process). Every tier returns
// the same value (SELFTEST there).
int64_t selftest() {
  alignas(64) uint16_t w[128], x[128];
  alignas(64) int8_t q[128], xq[128];
  alignas(64) float scale[32];
  alignas(64) int32_t corr[16] = {0};
  for (int i = 0; i < 128; ++i) {
    w[i] = float_to_bf16(static_cast<float>(i % 17 - 8) * 0.0625f);
    x[i] = float_to_bf16(static_cast<float>(i % 11 - 5) * 0.1f);
    q[i] = static_cast<int8_t>(i * 37 % 255 - 127);
    xq[i] = static_cast<int8_t>(i * 53 % 255 - 127);
  }
  for (int i = 0; i < 32; ++i) scale[i] = 0.5f + static_cast<float>(i) / 64.f;
  float d[1];
  const uint16_t* xs[1] = {x};
  dot_bf16<1>(w, xs, 100, d);  // a whole chunk and a tail
  const F16 e = fexp(fload(scale) * fset1(-3.f));
  const F16 a = i8dot(fzero(), i8load(q), xq, scale);
  const F16 b = i4dot(fzero(), i4load(reinterpret_cast<const uint8_t*>(q)), fload(scale + 16),
                      reinterpret_cast<const uint8_t*>(xq), corr, scale);
  uint16_t out[16];
  fstore_bf16(out, a + b + e + fset1(d[0]));
  uint64_t h = 1469598103934665603ull;
  for (uint16_t v : out) h = (h ^ v) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

void register_step(torch::Library& m);  // step.cpp

std::string tier() { return TIER; }

// The operators and classes, under the tier's namespace (bind.h); every argument is named here.
MOEPAGER_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("tier() -> str", &tier);
  m.def("selftest() -> int", &selftest);
  m.def("stream_read(Tensor x) -> int", MOEPAGER_CPU(stream_read));
  m.def("moe_partial(Tensor x, Tensor arena, Tensor token, Tensor weight, Tensor rows, Tensor spans, Tensor(a!) y, "
        MOEPAGER_FORMAT_SCHEMA ") -> ()", MOEPAGER_CPU(moe_partial));
  m.def("moe_combine(Tensor y, Tensor token, int n) -> Tensor", MOEPAGER_CPU(moe_combine));
  m.def("moe_resident(Tensor x, Tensor ids, Tensor weights, Tensor arena, int base, int num_experts, "
        MOEPAGER_FORMAT_SCHEMA ") -> Tensor", MOEPAGER_CPU(moe_resident));
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor", MOEPAGER_CPU(linear_bf16));
  m.def("linear_int8(Tensor x, Tensor q, Tensor scale) -> Tensor", MOEPAGER_CPU(linear_int8));
  register_step(m);
}
