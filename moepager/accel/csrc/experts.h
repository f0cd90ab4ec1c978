// One MoE layer's routed experts on the CPU (moe.cpp's calls, step.h's whole decoder layer): the (token,
// k) pairs sorted by expert, then two phases of tasks that any thread may take in any grouping -- gate and up rows with
// SiLU per (expert, 128-row tile), then down rows per 64-row tile of the output over every expert, each weighted by its
// routing weight in fp32 and (for a whole layer) summed per token in ascending expert order, rounded to bf16 once.
// A task's arithmetic does not depend on which thread runs it, so every split of the tasks gives the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "rows.h"

namespace {

struct Group {
  const uint8_t* buf;  // the expert's flat buffer
  int64_t begin, end;  // its sorted (token, k) pairs
};

constexpr int64_t TILE_F = 128;  // gate/up rows per task (a multiple of 128: whole activation chunks)
constexpr int64_t TILE_D = 64;  // down rows per task (long streams per expert: 64 rows of 768 bf16 are 96 KiB)

Projection gate_up_of(const Spec& s, const uint8_t* buf) {
  return {buf + s.off_gu, reinterpret_cast<const uint16_t*>(buf + s.off_sgu), 2 * s.F, s.D};
}
Projection down_of(const Spec& s, const uint8_t* buf) {
  return {buf + s.off_dn, reinterpret_cast<const uint16_t*>(buf + s.off_sdn), s.D, s.F};
}

// Each token's output for columns d0..d1: the sum of its y rows in sorted order in fp32, rounded to bf16 once. The one
// reduction both `moe_resident` and `moe_combine` run, so a paged layer equals a resident one bit for bit.
void combine_tile(const float* y, const int64_t* token, int64_t M, int64_t N, int64_t D, int64_t d0, int64_t d1,
                  uint16_t* out, std::vector<float>& acc) {
  const int64_t w = d1 - d0;
  acc.assign(N * w, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t d = d0; d < d1; ++d) acc[token[m] * w + d - d0] += y[m * D + d];
  for (int64_t t = 0; t < N; ++t) to_bf16(acc.data() + t * w, out + t * D + d0, w);
}

// Rows a..b of bf16 x [T, K] quantized for the integer formats into xq (sized by the caller).
void quantize_rows(const uint16_t* x, int64_t K, int64_t fmt, QBuffer& xq, int64_t a, int64_t b) {
  std::vector<float> row(K);
  for (int64_t t = a; t < b; ++t) {
    for (int64_t i = 0; i < K; ++i) row[i] = bf16_to_float(x[t * K + i]);
    quantize_row(row.data(), K, fmt, xq.row(t));
  }
}

// A layer's (token, k) pairs sorted by expert (a stable counting sort of ids [N, K], all in [0, E)): `token` and
// `weight` in sorted order, and one group per expert with pairs, its buffer at arena row base + e (row stride bytes).
struct SortedPairs {
  std::vector<int64_t> token;
  std::vector<float> weight;
  std::vector<Group> groups;
  void sort(const int64_t* ids, const float* weights, int64_t N, int64_t K, int64_t E, const uint8_t* arena,
            int64_t stride, int64_t base) {
    const int64_t M = N * K;
    std::vector<int64_t> count(E + 1, 0);
    for (int64_t i = 0; i < M; ++i) ++count[ids[i] + 1];
    for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
    std::vector<int64_t> fill(count.begin(), count.end() - 1);
    token.resize(M);
    weight.resize(M);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t at = fill[ids[i]]++;
      token[at] = i / K;
      weight[at] = weights[i];
    }
    groups.clear();
    for (int64_t e = 0; e < E; ++e)
      if (count[e + 1] > count[e]) groups.push_back({arena + (base + e) * stride, count[e], count[e + 1]});
  }
};

// The y rows (fp32 [M, D], routing-weighted) of every pair of `groups` for inputs x [N, D]; with `out` (bf16 [N, D])
// also each token's sum of its rows (then `groups` are all of the layer's pairs), plus `residual` (bf16 [N, D]) when
// given: out = bf16(residual + bf16(sum)), a decoder layer's second residual add. `prepare` (one thread) then the
// tasks of `up` (all of them, any threads), then those of `down`.
struct ExpertWork {
  Spec s{};
  const uint16_t* x = nullptr;
  const std::vector<Group>* groups = nullptr;
  const int64_t* token = nullptr;
  const float* weight = nullptr;
  float* y = nullptr;
  uint16_t* out = nullptr;
  const uint16_t* residual = nullptr;
  int64_t N = 0, M = 0, tiles_f = 0, tiles_d = 0;
  QBuffer xq, hq;  // inputs quantized once per token; SiLU(gate) * up quantized (integer formats)
  std::vector<uint16_t> hb;  // SiLU(gate) * up (bf16)

  // Everything but the inputs' quantization (`quantize_rows` over xq's N rows, before `up`).
  void prepare(const Spec& spec, const uint16_t* x_, int64_t n, const std::vector<Group>& g, const int64_t* token_,
               const float* weight_, float* y_, uint16_t* out_, const uint16_t* residual_ = nullptr) {
    s = spec, x = x_, N = n, groups = &g, token = token_, weight = weight_, y = y_, out = out_, residual = residual_;
    M = 0;
    for (const auto& gr : g) M = std::max(M, gr.end);
    if (s.fmt != BF16) {
      xq.resize(N, s.D, s.fmt);
      hq.resize(M, s.F, s.fmt);
    } else {
      hb.assign(M * s.F, 0);
    }
    tiles_f = (s.F + TILE_F - 1) / TILE_F;
    tiles_d = (s.D + TILE_D - 1) / TILE_D;
  }
  int64_t up_tasks() const { return static_cast<int64_t>(groups->size()) * tiles_f; }
  int64_t macs() const { return M * 3 * s.D * s.F; }

  // Phase 1, tasks a..b: gate and up rows of one (group, F tile), SiLU(gate) * up into hb / hq.
  void up(int64_t a, int64_t b) {
    const int64_t F = s.F, fmt = s.fmt;
    std::vector<float> gate, upv, h;
    std::vector<const uint16_t*> xb;
    std::vector<QRow> xr;
    for (int64_t task = a; task < b; ++task) {
      const Group& g = (*groups)[task / tiles_f];
      const int64_t f0 = (task % tiles_f) * TILE_F, f1 = std::min(F, f0 + TILE_F), n = g.end - g.begin;
      if (n <= 0) continue;
      const Projection p = gate_up_of(s, g.buf);
      xb.clear();
      xr.clear();
      for (int64_t m = g.begin; m < g.end; ++m) {
        if (fmt == BF16) xb.push_back(x + token[m] * s.D);
        else xr.push_back(xq.row(token[m]));
      }
      gate.assign(n * TILE_F, 0.f);
      upv.assign(n * TILE_F, 0.f);
      h.assign(n * TILE_F, 0.f);
      // the tile's gate rows f0..f1, then its up rows F + f0..F + f1 (two long streams, not alternating 16-row runs:
      // the prefetchers run on into rows the task reads next), written at column r - f0 of the tile's rows
      const uint16_t* const* xbp = fmt == BF16 ? xb.data() : nullptr;
      const QRow* xrp = fmt == BF16 ? nullptr : xr.data();
      rows_any(fmt, p, s.group, f0, f1, xbp, xrp, n, gate.data() - f0, TILE_F);
      rows_any(fmt, p, s.group, F + f0, F + f1, xbp, xrp, n, upv.data() - F - f0, TILE_F);
      for (int64_t i = 0; i < n; ++i) {
        float* hi = h.data() + i * TILE_F;
        swiglu(gate.data() + i * TILE_F, upv.data() + i * TILE_F, hi, f1 - f0);
        const int64_t m = g.begin + i;
        if (fmt == BF16) {
          to_bf16(hi, hb.data() + m * F + f0, f1 - f0);
        } else {
          const QRow row = hq.row(m);
          const int64_t w = chunk_inputs(fmt);
          for (int64_t c = f0 / w; c * w < f1; ++c)
            quantize_chunk(hi + (c * w - f0), std::min<int64_t>(w, f1 - c * w), fmt, row, c);
        }
      }
    }
  }

  // Phase 2, tasks a..b: down rows of one D tile over every group, weighted; then (with `out`) each token's sum.
  void down(int64_t a, int64_t b) {
    const int64_t D = s.D, F = s.F, fmt = s.fmt;
    std::vector<const uint16_t*> hbr;
    std::vector<QRow> hqr;
    std::vector<float> acc;
    for (int64_t task = a; task < b; ++task) {
      const int64_t d0 = task * TILE_D, d1 = std::min(D, d0 + TILE_D);
      for (const auto& g : *groups) {
        const int64_t n = g.end - g.begin;
        if (n <= 0) continue;
        hbr.clear();
        hqr.clear();
        for (int64_t m = g.begin; m < g.end; ++m) {
          if (fmt == BF16) hbr.push_back(hb.data() + m * F);
          else hqr.push_back(hq.row(m));
        }
        rows_any(fmt, down_of(s, g.buf), s.group, d0, d1, fmt == BF16 ? hbr.data() : nullptr,
                 fmt == BF16 ? nullptr : hqr.data(), n, y + g.begin * D, D);
        for (int64_t m = g.begin; m < g.end; ++m)
          for (int64_t d = d0; d < d1; ++d) y[m * D + d] *= weight[m];
      }
      if (out == nullptr) continue;
      combine_tile(y, token, M, N, D, d0, d1, out, acc);
      if (residual != nullptr)
        for (int64_t t = 0; t < N; ++t)
          add_bf16_row(residual + t * D + d0, out + t * D + d0, out + t * D + d0, d1 - d0);
    }
  }
};

// ExpertWork's phases on the kernels' threads (step.h's DecodeLayer runs them in a layer's own parallel region).
inline void run_layer(const Spec& s, const uint16_t* x, int64_t N, const std::vector<Group>& groups,
                      const int64_t* token, const float* weight, float* y, uint16_t* out) {
  ExpertWork w;
  w.prepare(s, x, N, groups, token, weight, y, out);
  if (s.fmt != BF16)  // (~16 operations an input)
    parallel_for(0, N, grain_for(N, N * s.D * 16), [&](int64_t a, int64_t b) { quantize_rows(x, s.D, s.fmt, w.xq, a, b); });
  parallel_for(0, w.up_tasks(), grain_for(w.up_tasks(), w.macs()), [&](int64_t a, int64_t b) { w.up(a, b); });
  parallel_for(0, w.tiles_d, grain_for(w.tiles_d, w.macs()), [&](int64_t a, int64_t b) { w.down(a, b); });
}

}  // namespace
