// moepager's CPU kernels for the rest of a decode step, beside the MoE layer's (cpu_moe.cpp; one extension, built by
// accel/cpu_kernels.py, given to the model by accel/step.py): RMSNorm, the softmax top-k router, one decode token's
// attention -- q/k RMSNorm, RoPE, the KV cache write and grouped-query attention over the paged cache -- and the
// sampler's greedy pick, one call each, and a whole decoder layer in one (DecodeLayer), where torch's eager ops take
// ~14 us a norm (seven ops), six ops a router and some twenty an attention.
//
// Arithmetic follows the torch path's roundings (models/attention.py): a norm sums x^2 in fp32 and rounds
// x * rsqrt(mean + eps) to bf16 before the weight's product (rounded again); RoPE rounds x * cos, rotate(x) * sin and
// their sum to bf16 each (bit-equal to the torch path); scores, softmax and the weighted sum of values in fp32, the
// output rounded to bf16 once. The order of the fp32 sums differs from torch's kernels, so a result may differ from
// theirs in its last bf16 bits (tests/accel/test_cpu_step.py states the bounds); the order is fixed whatever the
// thread count or the batch, so every row's result is the same alone or batched.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_experts.h"

namespace {

constexpr int64_t MAX_HEAD_DIM = 256;

// out = w * bf16(x * rsqrt(mean(x^2) + eps)) for one row of n.
inline void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load_bf16x16(x + i, tail_mask(n - i));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 y = round_bf16x16(_mm512_mul_ps(load_bf16x16(x + i, m), r));
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load_bf16x16(w + i, m), y)));
  }
}

// out = x * cos + roll(x, n/2) * signed_sin, each product and the sum rounded to bf16 (models/attention.py apply_rope).
inline void rope_row(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* out, int64_t n) {
  const int64_t half = n / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask(half - i);
    const __m512 lo = load_bf16x16(x + i, m), hi = load_bf16x16(x + half + i, m);
    const __m512 a = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(lo, load_bf16x16(c + i, m))),
                                   round_bf16x16(_mm512_mul_ps(hi, load_bf16x16(s + i, m))));
    const __m512 b = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(hi, load_bf16x16(c + half + i, m))),
                                   round_bf16x16(_mm512_mul_ps(lo, load_bf16x16(s + half + i, m))));
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(a));
    _mm256_mask_storeu_epi16(out + half + i, m, (__m256i)_mm512_cvtneps_pbh(b));
  }
}

// Softmax numerators e^(v - max) of row[0..n) in place, fp32; returns their sum (the attention's scores and the
// router's logits: one order of arithmetic for both).
inline float softmax_numerators(float* row, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(n - j), row + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 t = tail_mask(n - j);
    const __m512 e = _mm512_maskz_mov_ps(t, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(t, row + j), m)));
    _mm512_mask_storeu_ps(row + j, t, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// Row b's query heads g G .. g G + G - 1 (G = H / Hkv) and key head g of its qkv (H + Hkv heads of dh, then Hkv value
// heads) normed (w [H + Hkv, dh]; null: no norm) and rotated: the queries into q (G rows of dh, fp32 of their bf16
// values), key and value head g into the row's cache slot (2 Hkv heads).
void rotate_group(const uint16_t* qkv, const uint16_t* w, float eps, const uint16_t* cos, const uint16_t* sin,
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
void attend(const Cache& kv, int64_t b, int64_t g, int64_t lo, int64_t p, const float* q, int64_t G, float scale,
            std::vector<float>& sc, uint16_t* out) {
  const int64_t dh = kv.dh, L = p - lo + 1, chunks = (dh + 15) / 16, hkv = kv.heads2 / 2;
  sc.resize(G * L);
  __m512 kc[MAX_HEAD_DIM / 16];
  for (int64_t s = lo; s <= p; ++s) {
    const uint16_t* k = kv.slot(b, s) + g * dh;
    for (int64_t c = 0; c < chunks; ++c) kc[c] = load_bf16x16(k + c * 16, tail_mask(dh - c * 16));
    for (int64_t i = 0; i < G; ++i) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_mask(dh - c * 16), q + i * dh + c * 16), kc[c], acc);
      sc[i * L + (s - lo)] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  std::vector<float> inv(G);
  for (int64_t i = 0; i < G; ++i) inv[i] = 1.f / softmax_numerators(sc.data() + i * L, L);
  std::vector<__m512> acc(G * chunks, _mm512_setzero_ps());
  for (int64_t s = lo; s <= p; ++s) {
    const uint16_t* v = kv.slot(b, s) + (hkv + g) * dh;
    for (int64_t c = 0; c < chunks; ++c) kc[c] = load_bf16x16(v + c * 16, tail_mask(dh - c * 16));
    for (int64_t i = 0; i < G; ++i) {
      const __m512 w = _mm512_set1_ps(sc[i * L + (s - lo)]);
      for (int64_t c = 0; c < chunks; ++c) acc[i * chunks + c] = _mm512_fmadd_ps(w, kc[c], acc[i * chunks + c]);
    }
  }
  for (int64_t i = 0; i < G; ++i)
    for (int64_t c = 0; c < chunks; ++c) {
      const __mmask16 t = tail_mask(dh - c * 16);
      const __m512 o = _mm512_mul_ps(acc[i * chunks + c], _mm512_set1_ps(inv[i]));
      _mm256_mask_storeu_epi16(out + i * dh + c * 16, t, (__m256i)_mm512_cvtneps_pbh(o));
    }
}

}  // namespace

// RMSNorm over the last dimension of bf16 x: w * bf16(x * rsqrt(mean(x^2) + eps)), row i of x (as [M, n]) taking row
// i % R of the bf16 weight w [R, n] ([n]: one weight; [H, n]: per-head weights of [..., H, n] heads).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.device().is_cpu() &&
              w.device().is_cpu(), "rms_norm: bf16 CPU tensors");
  const int64_t n = x.size(-1);
  TORCH_CHECK(n > 0 && w.size(-1) == n && w.is_contiguous() && w.numel() % n == 0 && x.numel() % w.numel() == 0,
              "rms_norm: a contiguous weight [R, n] whose rows tile x's [..., n]");
  const auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t M = xc.numel() / n, R = w.numel() / n;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  auto rows = [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) norm_row(xp + i * n, wp + (i % R) * n, op + i * n, n, e);
  };
  if (M * n * 4 < SERIAL_MACS) {  // (~4 operations an input)
    rows(0, M);
  } else {
    pybind11::gil_scoped_release release;
    at::parallel_for(0, M, std::max<int64_t>(1, SERIAL_MACS / (4 * n)), rows);
  }
  return out;
}

namespace {

// One decode pass's attention over the paged cache, its arguments checked (`attention_of`): task t = (row b, KV head
// g) rotates and stores that row's heads of group g (rotate_group), then attends (attend). Tasks touch disjoint
// memory, so any thread may take any of them, and a row's result is the same alone or batched.
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

DecodeAttention attention_of(const torch::Tensor& qkv, const torch::Tensor& qk_w, double eps, const torch::Tensor& cos,
                             const torch::Tensor& sin, torch::Tensor& cache, const torch::Tensor& table,
                             const torch::Tensor& positions, int64_t H, int64_t window, double scale) {
  const auto bf16 = torch::kBFloat16;
  TORCH_CHECK(qkv.scalar_type() == bf16 && cos.scalar_type() == bf16 && sin.scalar_type() == bf16 &&
              cache.scalar_type() == bf16 && table.scalar_type() == torch::kLong &&
              positions.scalar_type() == torch::kLong, "decode_attention: bf16 tensors, int64 table and positions");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && cache.is_contiguous() &&
              table.is_contiguous() && positions.is_contiguous() && cache.dim() == 4 && table.dim() == 2 &&
              qkv.dim() == 2, "decode_attention: contiguous qkv [B, .], cache [blocks, bs, 2 Hkv, Dh], table [B, W]");
  const int64_t B = qkv.size(0), block = cache.size(1), heads2 = cache.size(2), dh = cache.size(3), hkv = heads2 / 2;
  const int64_t W = table.size(1), width = (H + heads2) * dh;
  TORCH_CHECK(heads2 % 2 == 0 && H > 0 && H % hkv == 0 && qkv.size(1) == width && table.size(0) == B &&
              positions.numel() == B && cos.numel() == B * dh && sin.numel() == B * dh && dh % 2 == 0 &&
              dh <= MAX_HEAD_DIM, "decode_attention: shapes of qkv, cos/sin, table or positions do not agree");
  const bool norm = qk_w.numel() > 0;
  TORCH_CHECK(!norm || (qk_w.scalar_type() == bf16 && qk_w.is_contiguous() && qk_w.numel() == (H + hkv) * dh),
              "decode_attention: qk_w [H + Hkv, Dh] bf16");
  const auto* pos = positions.data_ptr<int64_t>();
  const auto* tab = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < W * block, "decode_attention: position ", pos[b], " past the block table");
    for (int64_t j = 0; j <= pos[b] / block; ++j)
      TORCH_CHECK(tab[b * W + j] >= 0 && tab[b * W + j] < cache.size(0), "decode_attention: block out of range");
  }
  auto ptr = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  return {{reinterpret_cast<uint16_t*>(cache.data_ptr()), tab, W, block, heads2, dh}, ptr(qkv), ptr(cos), ptr(sin),
          norm ? ptr(qk_w) : nullptr, pos, B, H, hkv, dh, width, window, static_cast<float>(eps),
          static_cast<float>(scale)};
}

}  // namespace

// One decode token per row b, at position p = positions[b]: the q and k heads of qkv [B, (H + 2 Hkv) Dh] normed
// (qk_w [H + Hkv, Dh]; an empty tensor: no norm) and rotated (cos, signed sin [B, Dh]), k and v written to position
// p of the row's blocks in the paged cache [blocks, block size, 2 Hkv, Dh] (table [B, W]), then each query head
// attends to positions max(0, p - window + 1) (window 0: 0) to p of its KV head, scores scaled by `scale`.
// Returns the heads' outputs [B, H Dh] (bf16).
torch::Tensor decode_attention(const torch::Tensor& qkv, const torch::Tensor& qk_w, double eps,
                               const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor cache,
                               const torch::Tensor& table, const torch::Tensor& positions, int64_t H, int64_t window,
                               double scale) {
  const DecodeAttention att = attention_of(qkv, qk_w, eps, cos, sin, cache, table, positions, H, window, scale);
  auto out = torch::empty({att.B, H * att.dh}, qkv.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<float> q(att.B * H * att.dh);
  if (att.work() < SERIAL_MACS || att.tasks() == 1) {
    att.run(0, att.tasks(), q.data(), op);
  } else {
    pybind11::gil_scoped_release release;
    at::parallel_for(0, att.tasks(), 1, [&](int64_t a, int64_t z) { att.run(a, z, q.data(), op); });
  }
  return out;
}

namespace {

// One row x (D) routed by the bf16 router W [E, D]: probabilities p [E] (fp32 of the bf16 logits' softmax), the k
// largest in descending order (ties: the lower expert first) into ids and weights (divided by their sum with
// `normalize`). order: scratch of E.
void route_row(const uint16_t* x, const uint16_t* w, int64_t D, int64_t E, int64_t k, bool normalize, float* p,
               int64_t* ids, float* weights, std::vector<int64_t>& order) {
  for (int64_t e = 0; e < E; ++e) {
    dot_bf16<1>(w + e * D, &x, D, p + e);
    p[e] = round_bf16(p[e]);
  }
  const __m512 s = _mm512_set1_ps(softmax_numerators(p, E));
  for (int64_t e = 0; e < E; e += 16) {
    const __mmask16 tm = tail_mask(E - e);
    _mm512_mask_storeu_ps(p + e, tm, _mm512_div_ps(_mm512_maskz_loadu_ps(tm, p + e), s));
  }
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

}  // namespace

// Softmax top-k routing of bf16 x [N, D] by the bf16 router W [E, D], as models/moe.py's SoftmaxTopKRouter computes
// it: logits rounded to bf16 (a bf16 linear's output; its dot products as linear_bf16's), softmax in fp32, the k
// largest probabilities in descending order (ties: the lower expert first), with `normalize` divided by their sum.
// Returns ids [N, k] int64, weights [N, k] fp32 and probabilities [N, E] fp32.
std::vector<torch::Tensor> router_topk(const torch::Tensor& x, const torch::Tensor& w, int64_t k, bool normalize) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
              w.dim() == 2 && x.size(1) == w.size(1) && w.is_contiguous() && k >= 1 && k <= w.size(0),
              "router_topk: bf16 x [N, D] and contiguous W [E, D], 1 <= k <= E");
  const auto xc = x.contiguous();
  const int64_t N = xc.size(0), D = xc.size(1), E = w.size(0);
  auto probs = torch::empty({N, E}, x.options().dtype(torch::kFloat));
  auto weights = torch::empty({N, k}, probs.options());
  auto ids = torch::empty({N, k}, x.options().dtype(torch::kLong));
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* pp = probs.data_ptr<float>();
  float* wtp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  auto rows = [&](int64_t a, int64_t b) {
    std::vector<int64_t> order(E);
    for (int64_t t = a; t < b; ++t) route_row(xp + t * D, wp, D, E, k, normalize, pp + t * E, ip + t * k, wtp + t * k,
                                               order);
  };
  if (N * E * D < SERIAL_MACS) {
    rows(0, N);
  } else {
    pybind11::gil_scoped_release release;
    at::parallel_for(0, N, 1, rows);
  }
  return {ids, weights, probs};
}

namespace {

// Runs f(a, b) on this thread's share of `tasks` tasks (thread t of n; none when the share is empty).
template <class F>
inline void share(int64_t tasks, int t, int n, F&& f) {
  const int64_t a = tasks * t / n, b = tasks * (t + 1) / n;
  if (a < b) f(a, b);
}

// A bf16 projection's rows r0..r1 for the B rows x of one layer's pass (y: its fp32 scratch [B, N]), plus its bias.
void project(const torch::Tensor& w, const torch::Tensor& bias, const uint16_t* const* x, int64_t B, int64_t r0,
             int64_t r1, float* y, uint16_t* out) {
  const Projection p{static_cast<const uint8_t*>(w.data_ptr()), nullptr, w.size(0), w.size(1)};
  gemv_rows(BF16, p, x, nullptr, B, r0, r1, y, out);
  if (bias.numel() == 0) return;
  const auto* bp = reinterpret_cast<const uint16_t*>(bias.data_ptr());
  for (int64_t b = 0; b < B; ++b) add_bf16_row(out + b * p.N + r0, bp + r0, out + b * p.N + r0, r1 - r0);
}

}  // namespace

// One decoder layer of a decode pass (one token a row, bf16 x [B, D]) in one call, for the pre-norm block whose
// attention is decode_attention's and whose MLP is a softmax top-k router over resident experts (moe_resident's):
// h = x + o(attention(norm1(x))), out = h + experts(norm2(h)). The same kernels as the layer's modules call one by
// one (models/layers.py DecoderLayer with accel/step.py's kernels), each output element computed by the same
// arithmetic, so the two agree bit for bit; one Python call a layer instead of some twenty. The layer's weights and
// settings are bound once (a call converts seven arguments, not twenty-six). Empty tensors: no bias, no q/k norm.
// `bf16_weights`: the routing weights rounded to bf16 (Qwen-MoE's and OLMoE's routers), else kept fp32 (Mixtral's).
//
// With more than one thread the whole layer is one OpenMP parallel region: every step's tasks (16-row blocks of a
// projection, (row, KV head) attention tasks, the experts' tiles) are shared among the threads with a barrier between
// steps, where ATen's parallel_for would open a region per step (~4 us each) and leave a small model's steps on one
// core. The norm before q/k/v is computed by every thread for itself, the router's row by one.
struct DecodeLayer {
  torch::Tensor norm1, norm2;
  double eps;
  torch::Tensor qkv_w, qkv_b, qk_w;
  double qk_eps;
  int64_t heads, window;
  double scale;
  torch::Tensor o_w, o_b, router_w;
  int64_t k;
  bool normalize, bf16_weights;
  int64_t base, num_experts;
  std::vector<int64_t> spec;

  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                           torch::Tensor cache, const torch::Tensor& table, const torch::Tensor& positions,
                           const torch::Tensor& arena) const {
    const int64_t B = x.size(0), D = x.size(1), E = router_w.size(0);
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16 && qkv_w.size(1) == D &&
                o_w.size(0) == D && router_w.size(1) == D && E == num_experts && norm1.numel() == D &&
                norm2.numel() == D, "DecodeLayer: bf16 x [B, D] of the layer's width");
    auto qkv = torch::empty({B, qkv_w.size(0)}, x.options());
    const DecodeAttention att =
        attention_of(qkv, qk_w, qk_eps, cos, sin, cache, table, positions, heads, window, scale);
    TORCH_CHECK(o_w.size(1) == heads * att.dh, "DecodeLayer: o [D, H Dh]");
    const Spec s = parse_spec(spec);
    TORCH_CHECK(s.D == D, "DecodeLayer: experts of width ", s.D, " for x of ", D);
    const auto [rows, stride] = arena_rows(arena, base, num_experts);
    auto out = torch::empty({B, D}, x.options());
    Pass pass{*this, att, s, rows, stride, reinterpret_cast<const uint16_t*>(x.data_ptr()),
              reinterpret_cast<uint16_t*>(qkv.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr())};
    const int threads = at::get_num_threads();
    pybind11::gil_scoped_release release;
    if (threads > 1 && !at::in_parallel_region()) {
#pragma omp parallel num_threads(threads)
      pass.run(omp_get_thread_num(), omp_get_num_threads());
    } else {
      pass.run(0, 1);
    }
    return out;
  }

  // One call's buffers and steps. run(t, n) is thread t of n's part; its barriers and `single` bind to the enclosing
  // parallel region (none with n = 1: then they do nothing).
  struct Pass {
    const DecodeLayer& L;
    const DecodeAttention& att;
    const Spec& s;
    const uint8_t* rows;
    int64_t stride;
    const uint16_t* x;
    uint16_t* qkv;
    uint16_t* out;
    int64_t B = att.B, D = s.D, Nq = L.qkv_w.size(0), HD = L.heads * att.dh;
    std::vector<float> yq = std::vector<float>(B * Nq), yo = std::vector<float>(B * D), q = std::vector<float>(B * HD);
    std::vector<uint16_t> attended = std::vector<uint16_t>(B * HD), o = std::vector<uint16_t>(B * D),
                          h = std::vector<uint16_t>(B * D), h2 = std::vector<uint16_t>(B * D);
    std::vector<float> probs = std::vector<float>(B * L.num_experts), weights = std::vector<float>(B * L.k),
                       y = std::vector<float>(B * L.k * D);
    std::vector<int64_t> ids = std::vector<int64_t>(B * L.k);
    SortedPairs pairs;
    ExpertWork experts;

    void run(int t, int n) {
      const float eps = static_cast<float>(L.eps);
      std::vector<uint16_t> xn(B * D);  // norm1(x): each thread its own (the same bits)
      std::vector<const uint16_t*> in(B);
      for (int64_t b = 0; b < B; ++b) {
        norm_row(x + b * D, reinterpret_cast<const uint16_t*>(L.norm1.data_ptr()), xn.data() + b * D, D, eps);
        in[b] = xn.data() + b * D;
      }
      share((Nq + 15) / 16, t, n, [&](int64_t a, int64_t z) {
        project(L.qkv_w, L.qkv_b, in.data(), B, a * 16, std::min(Nq, z * 16), yq.data(), qkv);
      });
#pragma omp barrier
      share(att.tasks(), t, n, [&](int64_t a, int64_t z) { att.run(a, z, q.data(), attended.data()); });
#pragma omp barrier
      for (int64_t b = 0; b < B; ++b) in[b] = attended.data() + b * HD;
      share((D + 15) / 16, t, n, [&](int64_t a, int64_t z) {  // o, then h = x + o for those columns
        const int64_t r0 = a * 16, r1 = std::min(D, z * 16);
        project(L.o_w, L.o_b, in.data(), B, r0, r1, yo.data(), o.data());
        for (int64_t b = 0; b < B; ++b)
          add_bf16_row(x + b * D + r0, o.data() + b * D + r0, h.data() + b * D + r0, r1 - r0);
      });
#pragma omp barrier
#pragma omp single
      route(eps);  // (the barrier at its end: every thread waits for the sorted pairs)
      share(experts.up_tasks(), t, n, [&](int64_t a, int64_t z) { experts.up(a, z); });
#pragma omp barrier
      share(experts.tiles_d, t, n, [&](int64_t a, int64_t z) { experts.down(a, z); });
    }

    // h2 = norm2(h), its routing, the pairs sorted by expert and the experts' work prepared (one thread).
    void route(float eps) {
      const auto* n2 = reinterpret_cast<const uint16_t*>(L.norm2.data_ptr());
      const auto* rw = reinterpret_cast<const uint16_t*>(L.router_w.data_ptr());
      const int64_t E = L.num_experts, K = L.k;
      std::vector<int64_t> order;
      for (int64_t b = 0; b < B; ++b) {
        norm_row(h.data() + b * D, n2, h2.data() + b * D, D, eps);
        route_row(h2.data() + b * D, rw, D, E, K, L.normalize, probs.data() + b * E, ids.data() + b * K,
                  weights.data() + b * K, order);
      }
      if (L.bf16_weights)
        for (float& w : weights) w = round_bf16(w);
      pairs.sort(ids.data(), weights.data(), B, K, E, rows, stride, L.base);
      experts.prepare(s, h2.data(), B, pairs.groups, pairs.token.data(), pairs.weight.data(), y.data(), out, h.data());
      if (s.fmt != BF16) quantize_rows(h2.data(), D, s.fmt, experts.xq, 0, B);
    }
  };
};

// The sampler's greedy pick of logits [B, V] (bf16 or fp32, contiguous): each row's first largest entry and whether
// the row is finite (no NaN or infinity), as int64 [2, B]: tokens, then 1 (finite) or 0. Two passes over a row (its
// largest value and finiteness, then the first index holding it), where torch's path is five ops on an fp32 copy.
torch::Tensor greedy_rows(const torch::Tensor& logits) {
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || logits.scalar_type() == torch::kFloat) && logits.dim() == 2 && logits.is_contiguous() &&
              logits.size(1) > 0 && logits.device().is_cpu(), "greedy_rows: contiguous bf16 or fp32 logits [B, V]");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto out = torch::empty({2, B}, logits.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  for (int64_t b = 0; b < B; ++b) {
    auto load = [&](int64_t i, __mmask16 m) {
      return bf16 ? load_bf16x16(reinterpret_cast<const uint16_t*>(logits.data_ptr()) + b * V + i, m)
                  : _mm512_maskz_loadu_ps(m, logits.data_ptr<float>() + b * V + i);
    };
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = 0;
    for (int64_t i = 0; i < V; i += 16) {
      const __mmask16 m = tail_mask(V - i);
      const __m512 v = load(i, m);
      bad |= _mm512_mask_cmpeq_epi32_mask(m, _mm512_and_si512(_mm512_castps_si512(v), exponent), exponent);
      mx = _mm512_mask_max_ps(mx, m, mx, v);
    }
    const float best = _mm512_reduce_max_ps(mx);
    int64_t at = 0;
    if (!bad) {
      const __m512 target = _mm512_set1_ps(best);
      for (int64_t i = 0; i < V; i += 16) {
        const __mmask16 hit = _mm512_mask_cmpeq_ps_mask(tail_mask(V - i), load(i, tail_mask(V - i)), target);
        if (hit) {
          at = i + __builtin_ctz(hit);
          break;
        }
      }
    }
    op[b] = at;
    op[B + b] = bad ? 0 : 1;
  }
  return out;
}

void register_step(pybind11::module_& m) {
  m.def("greedy_rows", &greedy_rows);
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<torch::Tensor, torch::Tensor, double, torch::Tensor, torch::Tensor, torch::Tensor, double,
                          int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, bool, bool,
                          int64_t, int64_t, std::vector<int64_t>>())
      .def("__call__", &DecodeLayer::operator());
  m.def("router_topk", &router_topk);
  m.def("rms_norm", &rms_norm);
  m.def("decode_attention", &decode_attention);
}
