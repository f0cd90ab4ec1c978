// A torch-free harness of moepager's CPU kernels: every kernel of experts.h and step.h on fixed pseudo-random inputs,
// one line per case ("name hash", the FNV-1a hash of its output bytes), each case run at 1 and 3 threads (a case
// whose bits change with the thread count fails the run). Built per tier by tests/accel/test_cpu_tiers.py, natively
// and for ARM64 (cross-compiled, run under qemu-user); every tier must print the portable tier's lines.
//
//   harness [--threads N]   exit 0: all cases printed; 1: a case's bits depended on the thread count

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "step.h"

namespace {

struct Rng {  // xorshift64*, the same stream on every machine
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  float uniform() { return static_cast<float>((next() >> 40) * (1.0 / (1ull << 24))) * 2.f - 1.f; }  // [-1, 1)
  float normal() { return (uniform() + uniform() + uniform()) * 0.577f; }
};

std::vector<uint16_t> bf16s(size_t n, uint64_t seed, float scale = 1.f) {
  Rng r(seed);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(r.normal() * scale);
  return v;
}

uint64_t fnv(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
  return h;
}
template <class T>
uint64_t fnv(const std::vector<T>& v) { return fnv(v.data(), v.size() * sizeof(T)); }

// One expert format's arena of E experts (the byte layout experts/quant.py writes) and its spec.
struct Arena {
  Spec spec;
  int64_t stride;
  std::vector<uint8_t> bytes;
};

int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

Arena make_arena(int64_t fmt, int64_t D, int64_t F, int64_t group, int64_t E, uint64_t seed) {
  Rng r(seed);
  Arena a;
  if (fmt == BF16) {
    a.spec = {BF16, D, F, 0, 0, 2 * F * D * 2, 0, 0};
    a.stride = (2 * F * D + D * F) * 2;
    a.bytes.resize(E * a.stride);
    auto* w = reinterpret_cast<uint16_t*>(a.bytes.data());
    for (int64_t i = 0; i < E * a.stride / 2; ++i) w[i] = float_to_bf16(r.normal() * 0.1f);
    return a;
  }
  const bool int8 = fmt == INT8;
  const int64_t qgu = int8 ? 2 * F * D : 2 * F * D / 2, qdn = int8 ? D * F : D * F / 2;
  const int64_t sgu = int8 ? 2 * F : 2 * F * (D / group), sdn = int8 ? D : D * (F / group);
  const int64_t off_dn = align64(qgu), off_sgu = align64(off_dn + qdn), off_sdn = align64(off_sgu + sgu * 2);
  a.spec = {fmt, D, F, int8 ? 0 : group, 0, off_dn, off_sgu, off_sdn};
  a.stride = align64(off_sdn + sdn * 2);
  a.bytes.assign(E * a.stride, 0);
  for (int64_t e = 0; e < E; ++e) {
    uint8_t* buf = a.bytes.data() + e * a.stride;
    for (int64_t i = 0; i < qgu; ++i) buf[i] = int8 ? static_cast<uint8_t>(int8_t(r.next() % 255) - 127) : r.next();
    for (int64_t i = 0; i < qdn; ++i)
      buf[off_dn + i] = int8 ? static_cast<uint8_t>(int8_t(r.next() % 255) - 127) : r.next();
    auto* s = reinterpret_cast<uint16_t*>(buf + off_sgu);
    for (int64_t i = 0; i < sgu; ++i) s[i] = float_to_bf16((r.uniform() + 1.5f) * (int8 ? 0.001f : 0.01f));
    s = reinterpret_cast<uint16_t*>(buf + off_sdn);
    for (int64_t i = 0; i < sdn; ++i) s[i] = float_to_bf16((r.uniform() + 1.5f) * (int8 ? 0.001f : 0.01f));
  }
  return a;
}

struct Route {
  std::vector<int64_t> ids;
  std::vector<float> weights;
};

Route make_route(int64_t N, int64_t E, int64_t K, uint64_t seed) {
  Rng r(seed);
  Route out;
  for (int64_t t = 0; t < N; ++t) {
    std::vector<int64_t> all(E);
    for (int64_t e = 0; e < E; ++e) all[e] = e;
    for (int64_t k = 0; k < K; ++k) {
      std::swap(all[k], all[k + r.next() % (E - k)]);
      out.ids.push_back(all[k]);
      out.weights.push_back(round_bf16(r.uniform() * 0.5f + 0.5f));
    }
  }
  return out;
}

// A whole resident layer (moe.cpp's moe_resident): bf16 out [N, D].
std::vector<uint16_t> moe_resident(const Arena& a, const std::vector<uint16_t>& x, int64_t N, const Route& route,
                                   int64_t E, int64_t K) {
  SortedPairs pairs;
  pairs.sort(route.ids.data(), route.weights.data(), N, K, E, a.bytes.data(), a.stride, 0);
  std::vector<float> y(N * K * a.spec.D);
  std::vector<uint16_t> out(N * a.spec.D);
  run_layer(a.spec, x.data(), N, pairs.groups, pairs.token.data(), pairs.weight.data(), y.data(), out.data());
  return out;
}

// The same layer in two halves of its experts (moe_partial twice, then moe_combine): must give moe_resident's bits.
std::vector<uint16_t> moe_in_pieces(const Arena& a, const std::vector<uint16_t>& x, int64_t N, const Route& route,
                                    int64_t E, int64_t K) {
  SortedPairs pairs;
  pairs.sort(route.ids.data(), route.weights.data(), N, K, E, a.bytes.data(), a.stride, 0);
  const int64_t M = N * K, D = a.spec.D;
  std::vector<float> y(M * D);
  for (int part = 1; part >= 0; --part) {  // the odd groups land first
    std::vector<Group> some;
    for (size_t g = part; g < pairs.groups.size(); g += 2) some.push_back(pairs.groups[g]);
    run_layer(a.spec, x.data(), N, some, pairs.token.data(), pairs.weight.data(), y.data(), nullptr);
  }
  std::vector<uint16_t> out(N * D);
  std::vector<float> acc;
  for (int64_t d0 = 0; d0 < D; d0 += TILE_D)
    combine_tile(y.data(), pairs.token.data(), M, N, D, d0, std::min(D, d0 + TILE_D), out.data(), acc);
  return out;
}

std::vector<uint16_t> gemv(int64_t fmt, const std::vector<uint8_t>& w, const std::vector<uint16_t>& scale, int64_t N,
                           int64_t K, const std::vector<uint16_t>& x, int64_t T) {
  std::vector<const uint16_t*> xs(T);
  std::vector<QRow> xr(T);
  QBuffer xq;
  for (int64_t t = 0; t < T; ++t) xs[t] = x.data() + t * K;
  if (fmt != BF16) {
    xq.resize(T, K, fmt);
    quantize_rows(x.data(), K, fmt, xq, 0, T);
    for (int64_t t = 0; t < T; ++t) xr[t] = xq.row(t);
  }
  std::vector<float> y(T * N);
  std::vector<uint16_t> out(T * N);
  const Projection p{w.data(), scale.data(), N, K};
  parallel_for(0, (N + 15) / 16, 1, [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task)
      gemv_rows(fmt, p, fmt == BF16 ? xs.data() : nullptr, fmt == BF16 ? nullptr : xr.data(), T, task * 16,
                std::min(N, task * 16 + 16), y.data(), out.data());
  });
  return out;
}

// A paged KV cache of B rows, each at its own position, and one decode pass's attention over it.
struct AttentionCase {
  int64_t B = 3, H, hkv, dh, block = 4, W = 8, window;
  std::vector<int64_t> positions, table;
  std::vector<uint16_t> cache, qkv, cos, sin, qk_w;
  AttentionCase(int64_t H_, int64_t hkv_, int64_t dh_, int64_t window_, bool norm, uint64_t seed)
      : H(H_), hkv(hkv_), dh(dh_), window(window_) {
    positions = {2, 13, 29};
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < W; ++j) table.push_back((b * W + (j * 5) % W));
    cache = bf16s(B * W * block * 2 * hkv * dh, seed);
    qkv = bf16s(B * (H + 2 * hkv) * dh, seed + 1);
    cos = bf16s(B * dh, seed + 2, 0.7f);
    sin = bf16s(B * dh, seed + 3, 0.7f);
    if (norm) qk_w = bf16s((H + hkv) * dh, seed + 4, 0.3f);
  }
  DecodeAttention view() {
    return {{cache.data(), table.data(), W, block, 2 * hkv, dh}, qkv.data(), cos.data(), sin.data(),
            qk_w.empty() ? nullptr : qk_w.data(), positions.data(), B, H, hkv, dh, (H + 2 * hkv) * dh, window,
            1e-6f, 0.35f};
  }
};

// Each case: a name and the function computing its output's hash.
struct Case {
  std::string name;
  uint64_t (*run)();
};

template <int64_t FMT, int64_t D, int64_t F, int64_t G, int64_t N, bool PIECES>
uint64_t moe_case() {
  const int64_t E = 8, K = 3;
  const Arena a = make_arena(FMT, D, F, G, E, 7 + FMT + D);
  const auto x = bf16s(N * D, 11 + N);
  const Route route = make_route(N, E, K, 13 + N);
  return fnv(PIECES ? moe_in_pieces(a, x, N, route, E, K) : moe_resident(a, x, N, route, E, K));
}

template <int64_t FMT, int64_t N, int64_t K, int64_t T>
uint64_t gemv_case() {
  Rng r(17 + N);
  std::vector<uint8_t> w(FMT == BF16 ? N * K * 2 : N * K);
  std::vector<uint16_t> scale(N);
  if (FMT == BF16) {
    const auto b = bf16s(N * K, 19);
    std::memcpy(w.data(), b.data(), w.size());
  } else {
    for (auto& v : w) v = static_cast<uint8_t>(int8_t(r.next() % 255) - 127);
    for (auto& s : scale) s = float_to_bf16(0.01f * (r.uniform() + 1.5f));
  }
  return fnv(gemv(FMT, w, scale, N, K, bf16s(T * K, 23), T));
}

template <int64_t H, int64_t HKV, int64_t DH, int64_t WINDOW, bool NORM>
uint64_t attention_case() {
  AttentionCase c(H, HKV, DH, WINDOW, NORM, 29 + DH);
  const DecodeAttention att = c.view();
  std::vector<float> q(c.B * H * DH);
  std::vector<uint16_t> out(c.B * H * DH);
  parallel_for(0, att.tasks(), 1, [&](int64_t a, int64_t z) { att.run(a, z, q.data(), out.data()); });
  return fnv(out) ^ (fnv(c.cache) * 31);
}

uint64_t norm_case() {
  uint64_t h = 0;
  for (int64_t n : {33, 64, 256}) {
    const auto x = bf16s(5 * n, 31 + n, 3.f), w = bf16s(n, 37 + n, 0.5f);
    std::vector<uint16_t> out(5 * n);
    for (int64_t i = 0; i < 5; ++i) norm_row(x.data() + i * n, w.data(), out.data() + i * n, n, 1e-6f);
    h = h * 131 + fnv(out);
  }
  return h;
}

uint64_t router_case() {
  const int64_t N = 7, D = 100, E = 60, k = 4;
  const auto x = bf16s(N * D, 41), w = bf16s(E * D, 43, 0.05f);
  std::vector<float> probs(N * E), weights(N * k);
  std::vector<int64_t> ids(N * k);
  parallel_for(0, N, 1, [&](int64_t a, int64_t b) {
    route_rows(x.data(), w.data(), D, E, k, true, a, b, probs.data(), ids.data(), weights.data());
  });
  return fnv(probs) ^ (fnv(weights) * 3) ^ (fnv(ids) * 7);
}

uint64_t exp_case() {  // fexp and SiLU over [-100, 100], past the clamp both ways, and softmax rows
  std::vector<float> x(4096), y(4096), h(4096);
  for (int i = 0; i < 4096; ++i) x[i] = -100.f + 200.f * i / 4095.f;
  for (int i = 0; i < 4096; i += 16) fstore(y.data() + i, fexp(fload(x.data() + i)));
  swiglu(x.data(), y.data(), h.data(), 4095);
  std::vector<float> row(x.begin(), x.begin() + 1000);
  const float sum = softmax_numerators(row.data(), 999);
  return fnv(y) ^ (fnv(h) * 5) ^ (fnv(row) * 11) ^ (fnv(&sum, 4) * 13);
}

uint64_t convert_case() {  // fp32 -> bf16 rounding: ties, NaNs, infinities, the largest finite values
  const uint32_t bits[16] = {0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0x7fc00000u,
                             0x7f800001u, 0xffa00000u, 0x80000000u, 0x00800000u, 0x3f7fffffu, 0x40490fdbu,
                             0xc2c80000u, 0x3e4ccccdu, 0x00800001u, 0x477fe000u};
  float f[16];
  std::memcpy(f, bits, sizeof f);
  uint16_t out[16];
  fstore_bf16(out, fload(f));
  return fnv(out, sizeof out);
}

uint64_t greedy_case() {
  uint64_t h = 0;
  for (int64_t V : {1, 15, 16, 17, 1000}) {
    auto row = bf16s(V, 47 + V);
    h = h * 131 + greedy_row(V, [&](int64_t i, int64_t n) { return fload_bf16(row.data() + i, n); });
    row[V / 2] = 0x7fc0;  // a NaN: not finite
    h = h * 131 + greedy_row(V, [&](int64_t i, int64_t n) { return fload_bf16(row.data() + i, n); }) + 1;
  }
  return h;
}

uint64_t decode_layer_case() {  // a Qwen3-MoE-like layer: per-head q/k norm, GQA, 8 experts of which 2
  const int64_t H = 4, hkv = 2, dh = 16, D = 64, F = 32, E = 8, k = 2;
  AttentionCase c(H, hkv, dh, 0, true, 53);
  const Arena a = make_arena(BF16, D, F, 0, E, 59);
  const auto n1 = bf16s(D, 61, 0.3f), n2 = bf16s(D, 67, 0.3f), qkv_w = bf16s((H + 2 * hkv) * dh * D, 71, 0.1f);
  const auto o_w = bf16s(D * H * dh, 73, 0.1f), router = bf16s(E * D, 79, 0.1f), x = bf16s(c.B * D, 83);
  const LayerWeights L{n1.data(), n2.data(), 1e-6f, qkv_w.data(), nullptr, c.qk_w.data(), (H + 2 * hkv) * dh, 1e-6f,
                       H, 0, 0.25f, o_w.data(), nullptr, router.data(), k, true, true, 0, E, a.spec};
  std::vector<uint16_t> qkv(c.B * (H + 2 * hkv) * dh), out(c.B * D);
  DecodeAttention att = c.view();
  att.qkv = qkv.data();
  decode_layer(L, att, a.bytes.data(), a.stride, x.data(), qkv.data(), out.data(), kernel_threads());
  return fnv(out) ^ (fnv(c.cache) * 17);
}

const Case CASES[] = {
    {"moe bf16 100x72 1 token", moe_case<BF16, 100, 72, 0, 1, false>},
    {"moe bf16 100x72 7 tokens", moe_case<BF16, 100, 72, 0, 7, false>},
    {"moe bf16 256x128 33 tokens", moe_case<BF16, 256, 128, 0, 33, false>},
    {"moe bf16 256x128 33 tokens in pieces", moe_case<BF16, 256, 128, 0, 33, true>},
    {"moe int8 100x72 1 token", moe_case<INT8, 100, 72, 0, 1, false>},
    {"moe int8 192x200 7 tokens", moe_case<INT8, 192, 200, 0, 7, false>},
    {"moe int8 192x200 7 tokens in pieces", moe_case<INT8, 192, 200, 0, 7, true>},
    {"moe int4/32 96x64 1 token", moe_case<INT4, 96, 64, 32, 1, false>},
    {"moe int4/32 256x160 7 tokens", moe_case<INT4, 256, 160, 32, 7, false>},
    {"moe int4/64 256x192 5 tokens", moe_case<INT4, 256, 192, 64, 5, false>},
    {"moe int4/128 384x256 3 tokens", moe_case<INT4, 384, 256, 128, 3, false>},
    {"moe int4/32 256x160 7 tokens in pieces", moe_case<INT4, 256, 160, 32, 7, true>},
    {"gemv bf16 203x100 1 row", gemv_case<BF16, 203, 100, 1>},
    {"gemv bf16 203x100 5 rows", gemv_case<BF16, 203, 100, 5>},
    {"gemv bf16 64x2048 2 rows", gemv_case<BF16, 64, 2048, 2>},
    {"gemv int8 70x192 3 rows", gemv_case<INT8, 70, 192, 3>},
    {"attention 4/2 heads of 16, q/k norm", attention_case<4, 2, 16, 0, true>},
    {"attention 6/3 heads of 24, window 5", attention_case<6, 3, 24, 5, false>},
    {"attention 8/8 heads of 64", attention_case<8, 8, 64, 0, false>},
    {"rms norm", norm_case},
    {"router 60 experts top-4", router_case},
    {"exp, silu, softmax", exp_case},
    {"fp32 to bf16", convert_case},
    {"greedy", greedy_case},
    {"decode layer", decode_layer_case},
};

}  // namespace

int main(int argc, char** argv) {
  int threads = 3;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--threads") == 0) threads = std::atoi(argv[i + 1]);
  int status = 0;
  std::printf("tier %s\n", TIER);
  for (const Case& c : CASES) {
    harness_threads = 1;
    const uint64_t one = c.run();
    harness_threads = threads;
    const uint64_t many = c.run();
    std::printf("%s %016llx\n", c.name.c_str(), static_cast<unsigned long long>(one));
    if (one != many) {
      std::printf("  ^ differs at %d threads: %016llx\n", threads, static_cast<unsigned long long>(many));
      status = 1;
    }
  }
  return status;
}
