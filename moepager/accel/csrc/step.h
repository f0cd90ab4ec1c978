// The rest of a decode step on the CPU, torch-free (step.cpp binds it): RMSNorm, RoPE, the softmax top-k router,
// one decode token's attention over the paged KV cache (q/k norm, RoPE, the cache write, grouped-query attention),
// the greedy pick, and a whole decoder layer in one call (DecodeLayer).
//
// Arithmetic follows the torch path's roundings (models/attention.py): a norm sums x^2 in fp32 and rounds
// x * rsqrt(mean + eps) to bf16 before the weight's product (rounded again); RoPE rounds x * cos, rotate(x) * sin and
// their sum to bf16 each (bit-equal to the torch path); scores, softmax and the weighted sum of values in fp32, the
// output rounded to bf16 once. The order of the fp32 sums differs from torch's kernels, so a result may differ from
// theirs in its last bf16 bits (tests/accel/test_cpu_step.py states the bounds); the order is fixed whatever the
// thread count, the batch or the tier, so every row's result is the same alone or batched.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "experts.h"

namespace {

constexpr int64_t MAX_HEAD_DIM = 256;

// out = w * bf16(x * rsqrt(mean(x^2) + eps)) for one row of n.
inline void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps) {
  F16 acc = fzero();
  for (int64_t i = 0; i < n; i += 16) {
    const F16 v = fload_bf16(x + i, n - i);
    acc = acc + v * v;
  }
  const F16 r = fset1(1.f / std::sqrt(fsum(acc) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const F16 y = fround_bf16(fload_bf16(x + i, n - i) * r);
    fstore_bf16(out + i, fload_bf16(w + i, n - i) * y, n - i);
  }
}

// out = x * cos + roll(x, n/2) * signed_sin, each product and the sum rounded to bf16 (models/attention.py apply_rope).
inline void rope_row(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* out, int64_t n) {
  const int64_t half = n / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const int64_t m = half - i;
    const F16 lo = fload_bf16(x + i, m), hi = fload_bf16(x + half + i, m);
    const F16 a = fround_bf16(lo * fload_bf16(c + i, m)) + fround_bf16(hi * fload_bf16(s + i, m));
    const F16 b = fround_bf16(hi * fload_bf16(c + half + i, m)) + fround_bf16(lo * fload_bf16(s + half + i, m));
    fstore_bf16(out + i, a, m);
    fstore_bf16(out + half + i, b, m);
  }
}

// Softmax numerators e^(v - max) of row[0..n) in place, fp32; returns their sum (the attention's scores and the
// router's logits: one order of arithmetic for both).
inline float softmax_numerators(float* row, int64_t n) {
  F16 mx = fset1(-INFINITY), sum = fzero();
  for (int64_t j = 0; j < n; j += 16) mx = fmax(mx, ffill(fload(row + j, n - j), n - j, -INFINITY));
  const F16 top = fset1(fmaxall(mx));
  for (int64_t j = 0; j < n; j += 16) {
    const F16 e = ffill(fexp(fload(row + j, n - j) - top), n - j, 0.f);
    fstore(row + j, e, n - j);
    sum = sum + e;
  }
  return fsum(sum);
}

// Row b's query heads g G .. g G + G - 1 (G = H / Hkv) and key head g of its qkv (H + Hkv heads of dh, then Hkv value
// heads) normed (w [H + Hkv, dh]; null: no norm) and rotated: the queries into q (G rows of dh, fp32 of their bf16
// values), key and value head g into the row's cache slot (2 Hkv heads).
inline void rotate_group(const uint16_t* qkv, const uint16_t* w, float eps, const uint16_t* cos, const uint16_t* sin,
                         int64_t H, int64_t hkv, int64_t dh, int64_t g, uint16_t* slot, float* q) {
  uint16_t normed[MAX_HEAD_DIM], rotated[MAX_HEAD_DIM];
  auto rotate = [&](int64_t j, uint16_t* dst) {
    const uint16_t* src = qkv + j * dh;
    if (w != nullptr) {
      norm_row(src, w + j * dh, normed, dh, eps);
      src = normed;
    }
    rope_row(src, cos, sin, dst, dh);
  };
  const int64_t G = H / hkv;
  for (int64_t i = 0; i < G; ++i) {
    rotate(g * G + i, rotated);
    for (int64_t d = 0; d < dh; ++d) q[i * dh + d] = bf16_to_float(rotated[d]);
  }
  rotate(H + g, slot + g * dh);
  std::memcpy(slot + (hkv + g) * dh, qkv + (H + hkv + g) * dh, dh * sizeof(uint16_t));
}

struct Cache {
  uint16_t* data;
  const int64_t* table;  // [B, W] blocks of each row
  int64_t W, block, heads2, dh;  // heads2 = 2 Hkv: keys on heads 0..Hkv-1, values after
  uint16_t* slot(int64_t b, int64_t p) const {  // position p of row b: its 2 Hkv heads
    return data + (table[b * W + p / block] * block + p % block) * heads2 * dh;
  }
};

// Query heads g*G .. g*G+G-1 of row b (q: G rows of Dh fp32) against KV head g over positions [lo, p]: their outputs
// (bf16) into out. sc: scratch of G * (p - lo + 1) floats.
inline void attend(const Cache& kv, int64_t b, int64_t g, int64_t lo, int64_t p, const float* q, int64_t G,
                   float scale, std::vector<float>& sc, uint16_t* out) {
  const int64_t dh = kv.dh, L = p - lo + 1, chunks = (dh + 15) / 16, hkv = kv.heads2 / 2;
  sc.resize(G * L);
  F16 kc[MAX_HEAD_DIM / 16];
  for (int64_t s = lo; s <= p; ++s) {
    const uint16_t* k = kv.slot(b, s) + g * dh;
    for (int64_t c = 0; c < chunks; ++c) kc[c] = fload_bf16(k + c * 16, dh - c * 16);
    for (int64_t i = 0; i < G; ++i) {
      F16 acc = fzero();
      for (int64_t c = 0; c < chunks; ++c) acc = ffma(fload(q + i * dh + c * 16, dh - c * 16), kc[c], acc);
      sc[i * L + (s - lo)] = fsum(acc) * scale;
    }
  }
  std::vector<float> inv(G);
  for (int64_t i = 0; i < G; ++i) inv[i] = 1.f / softmax_numerators(sc.data() + i * L, L);
  std::vector<F16> acc(G * chunks, fzero());
  for (int64_t s = lo; s <= p; ++s) {
    const uint16_t* v = kv.slot(b, s) + (hkv + g) * dh;
    for (int64_t c = 0; c < chunks; ++c) kc[c] = fload_bf16(v + c * 16, dh - c * 16);
    for (int64_t i = 0; i < G; ++i) {
      const F16 w = fset1(sc[i * L + (s - lo)]);
      for (int64_t c = 0; c < chunks; ++c) acc[i * chunks + c] = ffma(w, kc[c], acc[i * chunks + c]);
    }
  }
  for (int64_t i = 0; i < G; ++i)
    for (int64_t c = 0; c < chunks; ++c)
      fstore_bf16(out + i * dh + c * 16, acc[i * chunks + c] * fset1(inv[i]), dh - c * 16);
}

// One decode pass's attention over the paged cache (arguments checked by the binding): task t = (row b, KV head g)
// rotates and stores that row's heads of group g (rotate_group), then attends (attend). Tasks touch disjoint memory,
// so any thread may take any of them, and a row's result is the same alone or batched.
struct DecodeAttention {
  Cache kv;
  const uint16_t *qkv, *cos, *sin, *qk_w;  // qk_w null: no q/k norm
  const int64_t* pos;
  int64_t B, H, hkv, dh, width, window;
  float eps, scale;

  int64_t tasks() const { return B * hkv; }
  int64_t work() const {  // multiply-adds of the scores and the weighted sum
    int64_t w = 0;
    for (int64_t b = 0; b < B; ++b) w += (pos[b] + 1) * H * dh * 2;
    return w;
  }
  // q: the rotated queries (fp32 [B, H Dh]); out: the heads' outputs (bf16 [B, H Dh])
  void run(int64_t a, int64_t z, float* q, uint16_t* out) const {
    std::vector<float> scratch;
    const int64_t G = H / hkv;
    for (int64_t t = a; t < z; ++t) {
      const int64_t b = t / hkv, g = t % hkv, p = pos[b], lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      float* qg = q + (b * H + g * G) * dh;
      rotate_group(qkv + b * width, qk_w, eps, cos + b * dh, sin + b * dh, H, hkv, dh, g, kv.slot(b, p), qg);
      attend(kv, b, g, lo, p, qg, G, scale, scratch, out + (b * H + g * G) * dh);
    }
  }
};

// One row x (D) routed by the bf16 router W [E, D]: probabilities p [E] (fp32 of the bf16 logits' softmax), the k
// largest in descending order (ties: the lower expert first) into ids and weights (divided by their sum with
// `normalize`). order: scratch of E.
inline void route_row(const uint16_t* x, const uint16_t* w, int64_t D, int64_t E, int64_t k, bool normalize, float* p,
                      int64_t* ids, float* weights, std::vector<int64_t>& order) {
  for (int64_t e = 0; e < E; ++e) {
    dot_bf16<1>(w + e * D, &x, D, p + e);
    p[e] = round_bf16(p[e]);
  }
  const F16 s = fset1(softmax_numerators(p, E));
  for (int64_t e = 0; e < E; e += 16) fstore(p + e, fload(p + e, E - e) / s, E - e);
  order.resize(E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [p](int64_t i, int64_t j) { return p[i] > p[j] || (p[i] == p[j] && i < j); });
  float total = 0.f;
  for (int64_t i = 0; i < k; ++i) total += p[order[i]];
  for (int64_t i = 0; i < k; ++i) {
    ids[i] = order[i];
    weights[i] = normalize ? p[order[i]] / total : p[order[i]];
  }
}

// Rows a..b of the router over N rows of x [N, D] (probs [N, E], ids and weights [N, k]).
inline void route_rows(const uint16_t* x, const uint16_t* w, int64_t D, int64_t E, int64_t k, bool normalize,
                       int64_t a, int64_t b, float* probs, int64_t* ids, float* weights) {
  std::vector<int64_t> order(E);
  for (int64_t t = a; t < b; ++t)
    route_row(x + t * D, w, D, E, k, normalize, probs + t * E, ids + t * k, weights + t * k, order);
}

// The greedy pick of one row of V logits (`load(i, n)`: lanes i.. of the row, n of them valid): its first largest
// entry, or -1 when the row holds a NaN or an infinity. Two passes (the largest value and finiteness, then the first
// index holding it), where torch's path is five ops on an fp32 copy.
template <class Load>
inline int64_t greedy_row(int64_t V, const Load& load) {
  F16 mx = fset1(-INFINITY);
  bool bad = false;
  for (int64_t i = 0; i < V; i += 16) {
    const F16 v = load(i, V - i);
    bad = bad || fnonfinite(v, V - i);
    mx = fmax(mx, ffill(v, V - i, -INFINITY));
  }
  if (bad) return -1;
  const float best = fmaxall(mx);
  for (int64_t i = 0; i < V; i += 16) {
    const int at = ffind(load(i, V - i), best, V - i);
    if (at >= 0) return i + at;
  }
  return 0;
}

// A bf16 projection's rows r0..r1 (W [N, K], bias [N] or null) for the B rows x of one layer's pass (y: its fp32
// scratch [B, N]), rounded to bf16 into out [B, N], plus the bias.
inline void project(const uint16_t* w, const uint16_t* bias, int64_t N, int64_t K, const uint16_t* const* x, int64_t B,
                    int64_t r0, int64_t r1, float* y, uint16_t* out) {
  const Projection p{reinterpret_cast<const uint8_t*>(w), nullptr, N, K};
  gemv_rows(BF16, p, x, nullptr, B, r0, r1, y, out);
  if (bias == nullptr) return;
  for (int64_t b = 0; b < B; ++b) add_bf16_row(out + b * N + r0, bias + r0, out + b * N + r0, r1 - r0);
}

// Runs f(a, b) on this thread's share of `tasks` tasks (thread t of n; none when the share is empty).
template <class F>
inline void share(int64_t tasks, int t, int n, F&& f) {
  const int64_t a = tasks * t / n, b = tasks * (t + 1) / n;
  if (a < b) f(a, b);
}

// One decoder layer's weights and settings (raw views; step.cpp keeps the tensors alive): the pre-norm block whose
// attention is DecodeAttention's and whose MLP is a softmax top-k router over resident experts (run_layer's).
// Null pointers: no bias, no q/k norm. `bf16_weights`: the routing weights rounded to bf16 (Qwen-MoE's and OLMoE's
// routers), else kept fp32 (Mixtral's).
struct LayerWeights {
  const uint16_t *norm1, *norm2;
  float eps;
  const uint16_t *qkv_w, *qkv_b, *qk_w;
  int64_t qkv_rows;
  float qk_eps;
  int64_t heads, window;
  float scale;
  const uint16_t *o_w, *o_b, *router_w;
  int64_t k;
  bool normalize, bf16_weights;
  int64_t base, num_experts;
  Spec spec;
};

// One decoder layer of a decode pass (one token a row, bf16 x [B, D]): h = x + o(attention(norm1(x))),
// out = h + experts(norm2(h)). The same kernels as the layer's modules call one by one (models/layers.py
// DecoderLayer with accel/step.py's kernels), each output element computed by the same arithmetic, so the two agree
// bit for bit.
//
// With more than one thread the whole layer is one OpenMP parallel region: every step's tasks (16-row blocks of a
// projection, (row, KV head) attention tasks, the experts' tiles) are shared among the threads with a barrier between
// steps, where a parallel_for per step (microseconds each) would leave a small model's steps on one core. The norm before
// q/k/v is computed by every thread for itself, the router's row by one. run(t, n) is thread t of n's part; its
// barriers and `single` bind to the enclosing parallel region (none with n = 1: then they do nothing).
struct DecodeLayerPass {
  const LayerWeights& L;
  const DecodeAttention& att;
  const uint8_t* rows;  // the arena's row `base`
  int64_t stride;
  const uint16_t* x;
  uint16_t* qkv;
  uint16_t* out;
  int64_t B = att.B, D = L.spec.D, Nq = L.qkv_rows, HD = L.heads * att.dh;
  std::vector<float> yq = std::vector<float>(B * Nq), yo = std::vector<float>(B * D), q = std::vector<float>(B * HD);
  std::vector<uint16_t> attended = std::vector<uint16_t>(B * HD), o = std::vector<uint16_t>(B * D),
                        h = std::vector<uint16_t>(B * D), h2 = std::vector<uint16_t>(B * D);
  std::vector<float> probs = std::vector<float>(B * L.num_experts), weights = std::vector<float>(B * L.k),
                     y = std::vector<float>(B * L.k * D);
  std::vector<int64_t> ids = std::vector<int64_t>(B * L.k);
  SortedPairs pairs;
  ExpertWork experts;

  void run(int t, int n) {
    std::vector<uint16_t> xn(B * D);  // norm1(x): each thread its own (the same bits)
    std::vector<const uint16_t*> in(B);
    for (int64_t b = 0; b < B; ++b) {
      norm_row(x + b * D, L.norm1, xn.data() + b * D, D, L.eps);
      in[b] = xn.data() + b * D;
    }
    share((Nq + 15) / 16, t, n, [&](int64_t a, int64_t z) {
      project(L.qkv_w, L.qkv_b, Nq, D, in.data(), B, a * 16, std::min(Nq, z * 16), yq.data(), qkv);
    });
#pragma omp barrier
    share(att.tasks(), t, n, [&](int64_t a, int64_t z) { att.run(a, z, q.data(), attended.data()); });
#pragma omp barrier
    for (int64_t b = 0; b < B; ++b) in[b] = attended.data() + b * HD;
    share((D + 15) / 16, t, n, [&](int64_t a, int64_t z) {  // o, then h = x + o for those columns
      const int64_t r0 = a * 16, r1 = std::min(D, z * 16);
      project(L.o_w, L.o_b, D, HD, in.data(), B, r0, r1, yo.data(), o.data());
      for (int64_t b = 0; b < B; ++b) add_bf16_row(x + b * D + r0, o.data() + b * D + r0, h.data() + b * D + r0, r1 - r0);
    });
#pragma omp barrier
#pragma omp single
    route();  // (the barrier at its end: every thread waits for the sorted pairs)
    share(experts.up_tasks(), t, n, [&](int64_t a, int64_t z) { experts.up(a, z); });
#pragma omp barrier
    share(experts.tiles_d, t, n, [&](int64_t a, int64_t z) { experts.down(a, z); });
  }

  // h2 = norm2(h), its routing, the pairs sorted by expert and the experts' work prepared (one thread).
  void route() {
    const int64_t E = L.num_experts, K = L.k;
    std::vector<int64_t> order;
    for (int64_t b = 0; b < B; ++b) {
      norm_row(h.data() + b * D, L.norm2, h2.data() + b * D, D, L.eps);
      route_row(h2.data() + b * D, L.router_w, D, E, K, L.normalize, probs.data() + b * E, ids.data() + b * K,
                weights.data() + b * K, order);
    }
    if (L.bf16_weights)
      for (float& w : weights) w = round_bf16(w);
    pairs.sort(ids.data(), weights.data(), B, K, E, rows, stride, 0);
    experts.prepare(L.spec, h2.data(), B, pairs.groups, pairs.token.data(), pairs.weight.data(), y.data(), out,
                    h.data());
    if (L.spec.fmt != BF16) quantize_rows(h2.data(), D, L.spec.fmt, experts.xq, 0, B);
  }
};

// The whole layer on `threads` threads (1: the calling thread alone).
inline void decode_layer(const LayerWeights& L, const DecodeAttention& att, const uint8_t* rows, int64_t stride,
                         const uint16_t* x, uint16_t* qkv, uint16_t* out, int threads) {
  DecodeLayerPass pass{L, att, rows, stride, x, qkv, out};
  if (threads > 1 && !in_parallel()) {
#pragma omp parallel num_threads(threads)
    pass.run(omp_get_thread_num(), omp_get_num_threads());
  } else {
    pass.run(0, 1);
  }
}

}  // namespace
