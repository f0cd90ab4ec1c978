// The rest of a decode step bound to torch (step.h holds the arithmetic): RMSNorm, the softmax top-k router, one
// decode token's attention over the paged cache, the sampler's greedy pick, one call each, and a whole decoder layer
// in one (DecodeLayer), where torch's eager ops take seven ops a norm, six a router and some twenty an attention. accel/step.py gives them to the model.

#include <cmath>
#include <cstring>
#include <vector>

#include "bind.h"
#include "step.h"

namespace {

const uint16_t* bf16_or_null(const torch::Tensor& t) { return t.numel() == 0 ? nullptr : bf16_data(t); }

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
  TORCH_CHECK(heads2 % 2 == 0 && H > 0 && hkv > 0 && H % hkv == 0 && qkv.size(1) == width && table.size(0) == B &&
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
  return {{reinterpret_cast<uint16_t*>(cache.data_ptr()), tab, W, block, heads2, dh}, bf16_data(qkv), bf16_data(cos),
          bf16_data(sin), norm ? bf16_data(qk_w) : nullptr, pos, B, H, hkv, dh, width, window,
          static_cast<float>(eps), static_cast<float>(scale)};
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
  const auto* xp = bf16_data(xc);
  const auto* wp = bf16_data(w);
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  auto rows = [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) norm_row(xp + i * n, wp + (i % R) * n, op + i * n, n, e);
  };
  if (M * n * 4 < SERIAL_MACS) {  // (~4 operations an input)
    rows(0, M);
  } else {
    parallel_for(0, M, std::max<int64_t>(1, SERIAL_MACS / (4 * n)), rows);
  }
  return out;
}

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
    parallel_for(0, att.tasks(), 1, [&](int64_t a, int64_t z) { att.run(a, z, q.data(), op); });
  }
  return out;
}

// Softmax top-k routing of bf16 x [N, D] by the bf16 router W [E, D], as models/moe.py's SoftmaxTopKRouter computes
// it: logits rounded to bf16 (a bf16 linear's output; its dot products as linear_bf16's), softmax in fp32, the k
// largest probabilities in descending order (ties: the lower expert first), with `normalize` divided by their sum.
// Returns ids [N, k] int64, weights [N, k] fp32 and probabilities [N, E] fp32.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> router_topk(const torch::Tensor& x, const torch::Tensor& w,
                                                                    int64_t k, bool normalize) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
              w.dim() == 2 && x.size(1) == w.size(1) && w.is_contiguous() && k >= 1 && k <= w.size(0),
              "router_topk: bf16 x [N, D] and contiguous W [E, D], 1 <= k <= E");
  const auto xc = x.contiguous();
  const int64_t N = xc.size(0), D = xc.size(1), E = w.size(0);
  auto probs = torch::empty({N, E}, x.options().dtype(torch::kFloat));
  auto weights = torch::empty({N, k}, probs.options());
  auto ids = torch::empty({N, k}, x.options().dtype(torch::kLong));
  const auto* xp = bf16_data(xc);
  const auto* wp = bf16_data(w);
  float* pp = probs.data_ptr<float>();
  float* wtp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  auto rows = [&](int64_t a, int64_t b) { route_rows(xp, wp, D, E, k, normalize, a, b, pp, ip, wtp); };
  if (N * E * D < SERIAL_MACS) {
    rows(0, N);
  } else {
    parallel_for(0, N, 1, rows);
  }
  return {ids, weights, probs};
}

// One decoder layer of a decode pass in one call (step.h's decode_layer). The layer's weights and settings are bound
// once (a call converts seven arguments, not twenty-six); the tensors are kept here, their data viewed by `L`. Empty
// tensors: no bias, no q/k norm.
namespace TORCH_EXTENSION_NAME {

struct DecodeLayer : torch::CustomClassHolder {
  std::vector<torch::Tensor> keep;
  LayerWeights L;

  DecodeLayer(torch::Tensor norm1, torch::Tensor norm2, double eps, torch::Tensor qkv_w, torch::Tensor qkv_b,
              torch::Tensor qk_w, double qk_eps, int64_t heads, int64_t window, double scale, torch::Tensor o_w,
              torch::Tensor o_b, torch::Tensor router_w, int64_t k, bool normalize, bool bf16_weights, int64_t base,
              int64_t num_experts, MOEPAGER_FORMAT_PARAMS) {
    for (const auto* t : {&norm1, &norm2, &qkv_w, &qkv_b, &qk_w, &o_w, &o_b, &router_w})
      TORCH_CHECK(t->numel() == 0 || (t->scalar_type() == torch::kBFloat16 && t->is_contiguous()),
                  "DecodeLayer: contiguous bf16 weights");
    TORCH_CHECK(qkv_w.dim() == 2 && o_w.dim() == 2 && router_w.dim() == 2 && router_w.size(0) == num_experts &&
                k >= 1 && k <= num_experts, "DecodeLayer: qkv [Nq, D], o [D, H Dh], router [E, D], 1 <= k <= E");
    keep = {norm1, norm2, qkv_w, qkv_b, qk_w, o_w, o_b, router_w};
    L = {bf16_data(norm1), bf16_data(norm2), static_cast<float>(eps), bf16_data(qkv_w), bf16_or_null(qkv_b),
         bf16_or_null(qk_w), qkv_w.size(0), static_cast<float>(qk_eps), heads, window, static_cast<float>(scale),
         bf16_data(o_w), bf16_or_null(o_b), bf16_data(router_w), k, normalize, bf16_weights, base, num_experts,
         MOEPAGER_FORMAT_SPEC};
  }

  // A call's checked views and outputs: what `run` computes, with no Python object touched (the GIL released).
  struct Pass {
    DecodeAttention att;
    const uint8_t* rows;
    int64_t stride;
    torch::Tensor qkv, out;
  };

  Pass prepare(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor cache,
               const torch::Tensor& table, const torch::Tensor& positions, const torch::Tensor& arena) const {
    const torch::Tensor &qkv_w = keep[2], &o_w = keep[5], &router_w = keep[7];
    const int64_t B = x.size(0), D = x.size(1);
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kBFloat16 && qkv_w.size(1) == D &&
                o_w.size(0) == D && router_w.size(1) == D && keep[0].numel() == D && keep[1].numel() == D &&
                L.spec.D == D, "DecodeLayer: bf16 x [B, D] of the layer's width");
    auto qkv = torch::empty({B, qkv_w.size(0)}, x.options());
    const DecodeAttention att =
        attention_of(qkv, keep[4], L.qk_eps, cos, sin, cache, table, positions, L.heads, L.window, L.scale);
    TORCH_CHECK(o_w.size(1) == L.heads * att.dh, "DecodeLayer: o [D, H Dh]");
    TORCH_CHECK(arena.dim() == 2 && arena.stride(1) == 1 && L.base >= 0 && L.base + L.num_experts <= arena.size(0),
                "the arena must be [rows, numel] with contiguous rows, rows base..base + num_experts in range");
    const int64_t stride = arena.stride(0) * arena.element_size();
    const auto* rows = static_cast<const uint8_t*>(arena.data_ptr()) + L.base * stride;
    return {att, rows, stride, qkv, torch::empty({B, D}, x.options())};
  }

  void run(const Pass& p, const uint16_t* x, int threads) const {
    decode_layer(L, p.att, p.rows, p.stride, x, reinterpret_cast<uint16_t*>(p.qkv.data_ptr()),
                 reinterpret_cast<uint16_t*>(p.out.data_ptr()), threads);
  }

  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                           torch::Tensor cache, const torch::Tensor& table, const torch::Tensor& positions,
                           const torch::Tensor& arena) const {
    const Pass p = prepare(x, cos, sin, cache, table, positions, arena);
    const int threads = kernel_threads();
    run(p, bf16_data(x), threads);
    return p.out;
  }
};

// A decode pass of the whole model in one call: the embedding's rows of the tokens, their positions' rows of the
// rotary tables, every DecodeLayer in order, the final norm and the LM head, returning bf16 logits [B, V] -- the
// same kernels in the same order as the model's modules with the step kernels (models/layers.py CausalLM with
// accel/step.py's DecodeLayerStep), so the logits agree bit for bit; one Python call a token where the modules take
// some dozens. The layers are the bound DecodeLayer objects (kept alive here); the head is [V, D] with no bias.
struct DecodeModel : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<DecodeLayer>> layers;
  torch::Tensor embed, norm, head;
  float eps;

  DecodeModel(torch::Tensor embed_w, std::vector<c10::intrusive_ptr<DecodeLayer>> layers_, torch::Tensor norm_w,
              double norm_eps, torch::Tensor head_w)
      : layers(std::move(layers_)), embed(embed_w), norm(norm_w), head(head_w), eps(static_cast<float>(norm_eps)) {
    for (const auto* t : {&embed, &norm, &head})
      TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->device().is_cpu(),
                  "DecodeModel: contiguous bf16 CPU embedding, norm and head");
    TORCH_CHECK(embed.dim() == 2 && head.dim() == 2 && head.size(1) == embed.size(1) && norm.numel() == embed.size(1)
                && !layers.empty(), "DecodeModel: embedding [V, D], norm [D], head [V', D] and at least one layer");
  }

  torch::Tensor operator()(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& cos_table,
                           const torch::Tensor& sin_table, const std::vector<torch::Tensor>& caches,
                           const torch::Tensor& table, const torch::Tensor& arena) const {
    TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.is_contiguous() && ids.dim() == 1 &&
                positions.scalar_type() == torch::kLong && positions.is_contiguous() &&
                positions.numel() == ids.numel(), "DecodeModel: int64 ids [B] and positions [B]");
    TORCH_CHECK(caches.size() == layers.size(), "DecodeModel: one cache a layer (", layers.size(), "), got ",
                caches.size());
    TORCH_CHECK(cos_table.scalar_type() == torch::kBFloat16 && sin_table.scalar_type() == torch::kBFloat16 &&
                cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.dim() == 2 &&
                sin_table.sizes() == cos_table.sizes(), "DecodeModel: bf16 rotary tables [P, Dh]");
    const int64_t B = ids.numel(), D = embed.size(1), V = embed.size(0), P = cos_table.size(0), dh = cos_table.size(1);
    const auto* id = ids.data_ptr<int64_t>();
    const auto* pos = positions.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(id[b] >= 0 && id[b] < V, "DecodeModel: token id ", id[b], " outside the vocabulary of ", V);
      TORCH_CHECK(pos[b] >= 0 && pos[b] < P, "DecodeModel: position ", pos[b], " past the rotary table's ", P);
    }
    auto x = torch::empty({B, D}, embed.options());
    auto cos = torch::empty({B, dh}, embed.options()), sin = torch::empty({B, dh}, embed.options());
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(x.data_ptr<at::BFloat16>() + b * D, bf16_data(embed) + id[b] * D, D * 2);
      std::memcpy(cos.data_ptr<at::BFloat16>() + b * dh, bf16_data(cos_table) + pos[b] * dh, dh * 2);
      std::memcpy(sin.data_ptr<at::BFloat16>() + b * dh, bf16_data(sin_table) + pos[b] * dh, dh * 2);
    }
    std::vector<DecodeLayer::Pass> passes;
    passes.reserve(layers.size());
    const torch::Tensor* in = &x;
    for (size_t i = 0; i < layers.size(); ++i) {
      passes.push_back(layers[i]->prepare(*in, cos, sin, caches[i], table, positions, arena));
      in = &passes.back().out;
    }
    const int64_t N = head.size(0);
    auto normed = torch::empty({B, D}, embed.options());
    auto yf = torch::empty({B, N}, embed.options().dtype(torch::kFloat));
    auto logits = torch::empty({B, N}, embed.options());
    const int threads = kernel_threads();
    const uint16_t* xp = bf16_data(x);
    for (size_t i = 0; i < layers.size(); ++i) {
      layers[i]->run(passes[i], xp, threads);
      xp = bf16_data(passes[i].out);
    }
    auto* np = reinterpret_cast<uint16_t*>(normed.data_ptr());
    std::vector<const uint16_t*> rows(B);
    for (int64_t b = 0; b < B; ++b) {
      norm_row(xp + b * D, bf16_data(norm), np + b * D, D, eps);
      rows[b] = np + b * D;
    }
    gemv_all(BF16, {static_cast<const uint8_t*>(head.data_ptr()), nullptr, N, D}, rows.data(), nullptr, B,
             yf.data_ptr<float>(), reinterpret_cast<uint16_t*>(logits.data_ptr()));  // as linear_bf16 computes it
    return logits;
  }
};

}  // namespace TORCH_EXTENSION_NAME

// The sampler's greedy pick of logits [B, V] (bf16 or fp32, contiguous): each row's first largest entry and whether
// the row is finite (no NaN or infinity), as int64 [2, B]: tokens, then 1 (finite) or 0.
torch::Tensor greedy_rows(const torch::Tensor& logits) {
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || logits.scalar_type() == torch::kFloat) && logits.dim() == 2 && logits.is_contiguous() &&
              logits.size(1) > 0 && logits.device().is_cpu(), "greedy_rows: contiguous bf16 or fp32 logits [B, V]");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto out = torch::empty({2, B}, logits.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t at;
    if (bf16) {
      const uint16_t* row = bf16_data(logits) + b * V;
      at = greedy_row(V, [row](int64_t i, int64_t n) { return fload_bf16(row + i, n); });
    } else {
      const float* row = logits.data_ptr<float>() + b * V;
      at = greedy_row(V, [row](int64_t i, int64_t n) { return fload(row + i, n); });
    }
    op[b] = at < 0 ? 0 : at;
    op[B + b] = at < 0 ? 0 : 1;
  }
  return out;
}

namespace ns = TORCH_EXTENSION_NAME;

void register_step(torch::Library& m) {
  m.def("greedy_rows(Tensor logits) -> Tensor", MOEPAGER_CPU(greedy_rows));
  m.def("router_topk(Tensor x, Tensor w, int k, bool normalize) -> (Tensor ids, Tensor weights, Tensor probs)",
        MOEPAGER_CPU(router_topk));
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", MOEPAGER_CPU(rms_norm));
  m.def("decode_attention(Tensor qkv, Tensor qk_w, float eps, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor table, "
        "Tensor positions, int heads, int window, float scale) -> Tensor", MOEPAGER_CPU(decode_attention));
  // The classes' constructors take their arguments by name (accel/step.py passes every one so).
  m.class_<ns::DecodeLayer>("DecodeLayer")
      .def(torch::init<torch::Tensor, torch::Tensor, double, torch::Tensor, torch::Tensor, torch::Tensor, double,
                       int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, bool, bool,
                       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>(), "",
           {torch::arg("norm1"), torch::arg("norm2"), torch::arg("eps"), torch::arg("qkv_w"), torch::arg("qkv_b"),
            torch::arg("qk_w"), torch::arg("qk_eps"), torch::arg("heads"), torch::arg("window"), torch::arg("scale"),
            torch::arg("o_w"), torch::arg("o_b"), torch::arg("router_w"), torch::arg("k"), torch::arg("normalize"),
            torch::arg("bf16_weights"), torch::arg("base"), torch::arg("num_experts"), torch::arg("fmt"),
            torch::arg("hidden"), torch::arg("intermediate"), torch::arg("group"), torch::arg("gate_up"),
            torch::arg("down"), torch::arg("gate_up_scales"), torch::arg("down_scales")})
      .def("run", &ns::DecodeLayer::operator());
  m.class_<ns::DecodeModel>("DecodeModel")
      .def(torch::init<torch::Tensor, std::vector<c10::intrusive_ptr<ns::DecodeLayer>>, torch::Tensor, double,
                       torch::Tensor>(), "",
           {torch::arg("embed"), torch::arg("layers"), torch::arg("norm"), torch::arg("eps"), torch::arg("head")})
      .def("run", &ns::DecodeModel::operator());
}

