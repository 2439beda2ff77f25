// The fused MoE layer on bf16 activations, on bf16 experts or weight-only int8 ones: the (token, choice) pairs routed
// to this rank's experts grouped by expert (group_by_expert), each expert's rows gathered and padded with zero rows to
// a multiple of 16 (an AMX tile), then two parallel passes, each reading every active expert's weights once, whatever
// the batch:
//  1. gate+up: one work item per (expert, w13 panel of 16 gate and 16 up rows): the panel product gives both halves
//     of SiLU(gate) * up for each row at once, written as bf16 to the intermediate activations [rows, Ip].
//  2. down: one work item per 32 output features: that panel of every active expert, then each token's weighted
//     choices summed in fp32 in k order straight into out: no [tokens * k, hidden] buffer, no two threads writing
//     the same output.
// Threads take chunks of consecutive items as they come (prefetching each next panel), so a skewed routing (every
// token to one expert) still splits that expert's rows.
// Products run on AMX tiles where the CPU has them (16-row tiles, or at decode short ones of the most rows any
// expert has), else on vdpbf16ps row tiles. int8 panels are widened to bf16 as the int8 GEMM widens them (exact), a
// k step at a time on AMX, and their per-channel scales applied to the fp32 sums. Gate, up and down are rounded to
// bf16 where the per-expert linears round them, so the layer gives their values up to the order of fp32 sums.

#include "gemm_bf16.h"
#include "gemm_int8.h"
#include "moe.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include <memory>

namespace ps {

namespace {

// kKStep: an AMX tile's k; H and I are padded to whole ones on every CPU, so that one packing serves both paths.
constexpr int64_t kP = 32, kHalfP = 16, kTileRows = 12, kGroup = 16, kKStep = 32;

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// Rows of a gathered buffer, `ld` elements apart: what amx_rows reads its A tiles from.
struct GatheredRows {
  const bf16_t* base;
  int64_t ld;
  const bf16_t* row(int64_t m) const { return base + m * ld; }
  int64_t stride(int64_t) const { return ld * int64_t(sizeof(bf16_t)); }
};

template <int MR>
void dp_rows(const bf16_t* x, int64_t ldx, const bf16_t* panel, int64_t K2, const bf16_t* pf, int64_t pf_lines,
             float* y) {
  __m512 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  dp_accumulate<MR>(a0, a1, x, ldx, panel, K2, pf, pf_lines);
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(y + r * kP, a0[r]);
    _mm512_storeu_ps(y + r * kP + 16, a1[r]);
  }
}
using DpRowsFn = void (*)(const bf16_t*, int64_t, const bf16_t*, int64_t, const bf16_t*, int64_t, float*);
constexpr DpRowsFn kDpRows[kTileRows + 1] = {nullptr,     dp_rows<1>,  dp_rows<2>, dp_rows<3>, dp_rows<4>,
                                             dp_rows<5>,  dp_rows<6>,  dp_rows<7>, dp_rows<8>, dp_rows<9>,
                                             dp_rows<10>, dp_rows<11>, dp_rows<12>};

// panel_product on vdpbf16ps row tiles over a bf16 panel, prefetching the next panel of W (bf16, or int8: the one
// to be widened next) alongside, each row tile a share.
template <typename W>
void dp_panel(const bf16_t* x, int64_t ldx, int64_t rows, const bf16_t* panel, int64_t K, const W* next, float* y) {
  int64_t tiles = 0;
  for (int64_t m = 0; m < rows; m += next_rows(rows - m, kTileRows)) ++tiles;
  for (int64_t m = 0, t = 0; m < rows; ++t) {
    const int64_t mr = next_rows(rows - m, kTileRows);
    const PrefetchShare share(next, K * kP * int64_t(sizeof(W)) / 64, t, tiles);
    kDpRows[mr](x + m * ldx, ldx, panel, K / 2, share.from, share.lines, y + m * kP);
    m += mr;
  }
}

// y [rows, 32] fp32 = `rows` rows of x (ldx apart, K columns) times one panel [K/2, 32, 2], prefetching the panel
// `next` (of the same size; or null) into L2 alongside: the next panel a thread runs is rarely the next one in memory
// (another expert's, or past the other thread's), so the hardware prefetchers would stall at each panel's start. On
// AMX, K is a multiple of 32, rows a multiple of 16 or the loaded tile config's short rows (rows of x past an
// expert's last are zeros), and this thread has that config loaded.
void panel_product(const bf16_t* x, int64_t ldx, int64_t rows, const bf16_t* panel, int64_t K, bool amx,
                   const bf16_t* next, float* y) {
#ifdef PS_AMX
  if (amx) {
    const GatheredRows a{x, ldx};
    const PanelSteps b(panel, K);
    for (int64_t m = 0; m < rows; m += 2 * kAmxR)
      amx_rows(a, b, m, std::min(2 * kAmxR, rows - m), nullptr, reinterpret_cast<float(*)[kAmxN]>(y + m * kP),
               m == 0 ? next : nullptr);
    return;
  }
#endif
  (void)amx;
  dp_panel(x, ldx, rows, panel, K, next, y);
}

// The same for an int8 panel [K, 32] (next: the next int8 panel), before its scales.
void panel_product(const bf16_t* x, int64_t ldx, int64_t rows, const int8_t* panel, int64_t K, bool amx,
                   const int8_t* next, float* y) {
#ifdef PS_AMX
  if (amx) {
    const GatheredRows a{x, ldx};
    for (int64_t m = 0; m < rows; m += 2 * kAmxR)
      amx_rows(a, WidenedSteps(panel, m == 0 ? next : nullptr, K), m, std::min(2 * kAmxR, rows - m), nullptr,
               reinterpret_cast<float(*)[kAmxN]>(y + m * kP), nullptr);
    return;
  }
#endif
  (void)amx;
  dp_panel(x, ldx, rows, widened_panel(panel, K), K, next, y);
}

__m512 round_trip_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// A per-thread fp32 scratch of at least n floats.
float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// item(i, next) for i in [0, n) on the pool's threads, in chunks of consecutive items (ChunkQueue), each thread
// with the tile config for `tile_rows` rows loaded where `amx`; next: the item this thread runs after i, or -1.
template <typename Item>
void run_items(int64_t n, bool amx, int64_t tile_rows, const Item& item) {
  const int64_t threads = std::min(kernel_threads(), n);
  ChunkQueue queue(n, threads);
  run_parallel(threads, [&] {
#ifdef PS_AMX
    const TileConfig cfg(tile_rows);
    if (amx) _tile_loadconfig(&cfg);
#endif
    for (auto cur = queue.claim(); cur.first < n;) {
      const auto next = queue.claim();
      for (int64_t i = cur.first; i < cur.second; ++i)
        item(i, i + 1 < cur.second ? i + 1 : next.first < n ? next.first : -1);
      cur = next;
    }
#ifdef PS_AMX
    if (amx) _tile_release();
#endif
  });
  (void)amx;
  (void)tile_rows;
}

// The layer on panels of W (bf16_t or int8_t, with per-column scales s13, s2; null for bf16), after the checks.
template <typename W>
void moe_run(const bf16_t* xp, const int64_t* ids, const float* weights, int64_t T, int64_t H, int64_t K,
             int64_t expert_start, int64_t E, int64_t P13, const W* wp13, const float* s13, const W* wp2,
             const float* s2, bool amx, bf16_t* y) {
  const int64_t Hp = round_up(H, kKStep), Ip = P13 * kHalfP, P2 = (H + kP - 1) / kP;
  const Routes routes = group_by_expert(ids, T, K, expert_start, E);
  // Expert e's rows start at at[e] in the gathered buffers, each group padded to a multiple of 16 rows.
  std::vector<int64_t> at(E + 1, 0), token_at;
  for (int64_t e = 0; e < E; ++e) at[e + 1] = at[e] + round_up(routes.start[e + 1] - routes.start[e], kGroup);
  const int64_t R = at[E];
  if (R == 0) {
    std::fill(y, y + T * H, bf16_t(0));
    return;
  }
  token_at.assign(R, -1);
  for (const int64_t e : routes.active)
    for (int64_t r = routes.start[e]; r < routes.start[e + 1]; ++r)
      token_at[at[e] + r - routes.start[e]] = routes.token[r];
  // AMX runs whole 16-row tiles, or, where no expert has 16 rows (decode), short tiles of the most any has: a
  // tile's multiply takes cycles by its rows, and short ones streamed the weights ~10% faster.
  int64_t most = 0;
  for (const int64_t e : routes.active) most = std::max(most, routes.start[e + 1] - routes.start[e]);
  const int64_t tile_rows = std::min(most, kGroup);
  auto rows_of = [&](int64_t e) {
    if (!amx) return routes.start[e + 1] - routes.start[e];
    return tile_rows < kGroup ? tile_rows : at[e + 1] - at[e];
  };

  std::unique_ptr<bf16_t[]> xs(new bf16_t[R * Hp]), act(new bf16_t[R * Ip]);
  parallel_for(0, R, std::max<int64_t>(1, 8192 / Hp), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      bf16_t* row = xs.get() + r * Hp;
      const int64_t copied = token_at[r] < 0 ? 0 : H;
      if (copied) std::memcpy(row, xp + token_at[r] * H, H * sizeof(bf16_t));
      std::fill(row + copied, row + Hp, bf16_t(0));
    }
  });

  // 1. act = SiLU(x W_gate^T) * (x W_up^T), per active expert and w13 panel.
  const int64_t active = int64_t(routes.active.size());
  auto w13_panel = [&](int64_t item) { return wp13 + (routes.active[item / P13] * P13 + item % P13) * Hp * kP; };
  run_items(active * P13, amx, tile_rows, [&](int64_t item, int64_t next) {
    const int64_t e = routes.active[item / P13], q = item % P13, rows = rows_of(e);
    float* gate_up = scratch(round_up(rows, kGroup) * kP);
    panel_product(xs.get() + at[e] * Hp, Hp, rows, w13_panel(item), Hp, amx, next < 0 ? nullptr : w13_panel(next),
                  gate_up);
    const float* sc = s13 == nullptr ? nullptr : s13 + (e * P13 + q) * kP;
    const __m512 sg = sc ? _mm512_loadu_ps(sc) : _mm512_set1_ps(1.f), su = sc ? _mm512_loadu_ps(sc + 16) : sg;
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 g = round_trip_bf16(_mm512_mul_ps(_mm512_loadu_ps(gate_up + r * kP), sg));
      const __m512 u = round_trip_bf16(_mm512_mul_ps(_mm512_loadu_ps(gate_up + r * kP + kHalfP), su));
      const __m512 e_g = (__m512)exp16v((f32x16)_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 a = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e_g)), u);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(act.get() + (at[e] + r) * Ip + q * kHalfP),
                          (__m256i)_mm512_cvtneps_pbh(a));
    }
  });

  // 2. out[t] = sum_k weight[t, k] * (act[row(t, k)] W_down^T), per panel of 32 output features.
  std::vector<int64_t> row_at(T * K, -1);  // the gathered row of (t, k), or -1
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t r = routes.row_of[i];
    if (r < 0) continue;
    const int64_t e = ids[i] - expert_start;
    row_at[i] = at[e] + r - routes.start[e];
  }
  auto w2_panel = [&](int64_t e, int64_t p) { return wp2 + (e * P2 + p) * Ip * kP; };
  run_items(P2, amx, tile_rows, [&](int64_t p, int64_t next) {
    float* down = scratch(R * kP);
    for (int64_t i = 0; i < active; ++i) {
      const int64_t e = routes.active[i];
      const W* pf = i + 1 < active ? w2_panel(routes.active[i + 1], p)
                         : next >= 0    ? w2_panel(routes.active[0], next)
                                        : nullptr;
      panel_product(act.get() + at[e] * Ip, Ip, rows_of(e), w2_panel(e, p), Ip, amx, pf, down + at[e] * kP);
      if (s2 == nullptr) continue;
      const __m512 c0 = _mm512_loadu_ps(s2 + (e * P2 + p) * kP), c1 = _mm512_loadu_ps(s2 + (e * P2 + p) * kP + 16);
      for (float* d = down + at[e] * kP; d < down + (at[e] + rows_of(e)) * kP; d += kP) {
        _mm512_storeu_ps(d, _mm512_mul_ps(_mm512_loadu_ps(d), c0));
        _mm512_storeu_ps(d + 16, _mm512_mul_ps(_mm512_loadu_ps(d + 16), c1));
      }
    }
    const int64_t n0 = p * kP, ncols = std::min(kP, H - n0);
    const __mmask16 m0 = ncols >= 16 ? 0xFFFF : (1u << ncols) - 1;
    const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols > 16 ? (1u << (ncols - 16)) - 1 : 0;
    for (int64_t t = 0; t < T; ++t) {
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = row_at[t * K + k];
        if (r < 0) continue;
        const __m512 w = _mm512_set1_ps(weights[t * K + k]);
        s0 = _mm512_add_ps(s0, _mm512_mul_ps(round_trip_bf16(_mm512_loadu_ps(down + r * kP)), w));
        s1 = _mm512_add_ps(s1, _mm512_mul_ps(round_trip_bf16(_mm512_loadu_ps(down + r * kP + 16)), w));
      }
      _mm256_mask_storeu_epi16(y + t * H + n0, m0, (__m256i)_mm512_cvtneps_pbh(s0));
      if (m1) _mm256_mask_storeu_epi16(y + t * H + n0 + 16, m1, (__m256i)_mm512_cvtneps_pbh(s1));
    }
  });
}

}  // namespace

void moe_bf16(torch::Tensor x, torch::Tensor topk_ids, torch::Tensor topk_weights, int64_t expert_start,
              torch::Tensor w13, torch::Tensor w2, torch::Tensor out, bool use_amx, torch::Tensor w13_scale,
              torch::Tensor w2_scale) {
  check_layer_args(x, topk_ids, topk_weights, out, torch::kBFloat16);
  const int64_t T = x.size(0), H = x.size(1), K = topk_ids.size(1), Hp = round_up(H, kKStep);
  const bool int8 = w13.scalar_type() == torch::kChar;
  TORCH_CHECK(int8 || w13.scalar_type() == torch::kBFloat16, "expert panels: bf16 or int8");
  // A panel of either type holds K x 32 elements: [K/2, 32, 2] bf16 or [K, 32] int8.
  const auto panels_ok = [&](const torch::Tensor& w, int64_t k) {
    if (!w.is_contiguous() || w.scalar_type() != w13.scalar_type()) return false;
    return int8 ? w.dim() == 4 && w.size(2) == k && w.size(3) == kP
                : w.dim() == 5 && w.size(2) * 2 == k && w.size(3) == kP && w.size(4) == 2;
  };
  TORCH_CHECK(panels_ok(w13, Hp), "w13: [E, Ip/16, Hp/2, 32, 2] bf16 or [E, Ip/16, Hp, 32] int8");
  const int64_t E = w13.size(0), P13 = w13.size(1), Ip = P13 * kHalfP, P2 = (H + kP - 1) / kP;
  TORCH_CHECK(Ip % kKStep == 0 && panels_ok(w2, Ip) && w2.size(0) == E && w2.size(1) == P2,
              "w2: [E, ceil(H/32), Ip/2, 32, 2] bf16 or [E, ceil(H/32), Ip, 32] int8, Ip a multiple of 32");
  TORCH_CHECK(!int8 || (w13_scale.is_contiguous() && w13_scale.scalar_type() == torch::kFloat &&
                        w13_scale.numel() == E * P13 * kP && w2_scale.is_contiguous() &&
                        w2_scale.scalar_type() == torch::kFloat && w2_scale.numel() == E * P2 * kP),
              "int8 panels: fp32 scales [E, Ip/16, 32] and [E, ceil(H/32), 32]");
  if (T == 0) return;
  bool amx = false;
#ifdef PS_AMX
  amx = use_amx && amx_usable();
#endif
  (void)use_amx;
  const bf16_t* xp = ptr<bf16_t>(x);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* weights = topk_weights.data_ptr<float>();
  bf16_t* y = mut_ptr<bf16_t>(out);
  if (int8)
    moe_run(xp, ids, weights, T, H, K, expert_start, E, P13, ptr<int8_t>(w13), w13_scale.data_ptr<float>(),
            ptr<int8_t>(w2), w2_scale.data_ptr<float>(), amx, y);
  else
    moe_run<bf16_t>(xp, ids, weights, T, H, K, expert_start, E, P13, ptr<bf16_t>(w13), nullptr, ptr<bf16_t>(w2),
                    nullptr, amx, y);
}

bool moe_bf16_built() { return true; }

}  // namespace ps
#else
namespace ps {
void moe_bf16(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, torch::Tensor, torch::Tensor, torch::Tensor,
              bool, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}
bool moe_bf16_built() { return false; }
}  // namespace ps
#endif
