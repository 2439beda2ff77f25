// Weight-only int8 GEMM for CPU linears, y = (x @ q.T) * scale (+ bias), on int8 weights packed once into panels.
//
// A panel holds 32 output features as [K, 32] int8, so a row tile streams its weights as one contiguous run of
// 32 bytes per k: a quarter of the fp32 panel's bytes, half the bf16 one's, which is what decode (a few rows, bound
// by weight reads) gains. Weights widen to fp32 in registers (int8 -> fp32 is exact) and meet the activations
// (fp32, or bf16 widened once per call, also exact) in FMAs; the per-channel scale and the bias are applied once
// per output, which is then written once (rounded to bf16 for bf16 activations, or kept fp32 for logits).
//
// 7+ bf16 rows where the CPU has AVX512-BF16: each panel is first widened into a per-thread bf16 copy in
// vdpbf16ps's k-pair layout (int8 -> bf16 is exact), which every row tile of the block then reads, at twice the
// FMA path's multiply rate, while the tiles prefetch the next panel. vdpbf16ps adds the odd k's product, then the
// even k's, each exact and rounded once; the FMA path takes each pair in that order too, so a row's result is
// bitwise the same in any batch, whichever path runs it (denormal activations aside, which vdpbf16ps flushes).
//
// Where the CPU has AMX, 4+ bf16 rows take the widened panels through AMX tiles (amx.h) instead: from 4 rows they
// outrun the FMA tiles (below, widening each panel costs more than the FMA path's conversions). AMX sums 32 k a
// step, not bitwise as the FMA path does, so there a row's result is the same in any batch of 4+ rows, and in any
// of fewer, but not across the two.
//
// Written with GCC vector extensions (AVX-512, AVX2 or NEON, whatever -march=native gives) but for the vdpbf16ps
// tile. Threads claim (block of rows, panel) units as the bf16 panel GEMM does.

#include "gemm_int8.h"


namespace ps {

#ifdef __AVX512F__
constexpr int kQMR = 8;  // 16 accumulators of 32 zmm
#else
constexpr int kQMR = 4;  // 8 accumulators of 16 ymm-pairs
#endif
constexpr int64_t kQMC = 48;  // rows per block on the FMA path: their fp32 activations stay in L2
inline f32x16 splat16(float v) { return f32x16{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }

// The 32 columns' scale and bias from column n0 on (ncols of them), zero past ncols.
template <typename B>
struct Epilogue {
  f32x16 s0, s1, b0, b1;
  Epilogue(const float* scale, const B* bias, int64_t ncols) {
    float s[kQNR] = {}, b[kQNR] = {};
    std::memcpy(s, scale, ncols * sizeof(float));
    if (bias != nullptr)
      for (int64_t i = 0; i < ncols; ++i) b[i] = load1(bias + i);
    s0 = load16(s); s1 = load16(s + 16); b0 = load16(b); b1 = load16(b + 16);
  }
  template <typename Out>
  void store(Out* y, f32x16 a0, f32x16 a1, int64_t ncols) const {
    a0 = a0 * s0 + b0;
    a1 = a1 * s1 + b1;
    if (ncols == kQNR) { store16(y, a0); store16(y + 16, a1); return; }
    Out t[kQNR];
    store16(t, a0); store16(t + 16, a1);
    std::memcpy(y, t, ncols * sizeof(Out));
  }
};

// y[r][32i : 32i + ncols_i] = epilogue_i(sum_k x[r][k] * p_i[k][0:32]) for rows r < MR and NP consecutive panels
// p_i = p + i K 32 (several panels give one or two rows enough independent FMA chains to stream weights rather than
// wait on FMA latency; each output is still summed in the same order). fp32 activations; k in pairs, odd before
// even (see the top), then the last k of an odd K. Alongside, pf_lines cache lines from pf (the thread's next
// panels, or null) into L2, spread over the k loop.
template <int MR, int NP, typename B, typename Out>
void fma_tile(const float* x, int64_t ldx, const int8_t* p, int64_t K, Out* y, int64_t ldy, const int64_t* ncols,
              const Epilogue<B>* ep, const void* pf, int64_t pf_lines) {
  f32x16 a0[NP][MR], a1[NP][MR];
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < MR; ++r) { a0[i][r] = f32x16{}; a1[i][r] = f32x16{}; }
  auto step = [&](int64_t k) __attribute__((always_inline)) {
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) {
      const int8_t* w = p + i * K * kQNR + k * kQNR;
      const f32x16 w0 = widen_i8(w), w1 = widen_i8(w + 16);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const f32x16 xv = splat16(x[r * ldx + k]);
        a0[i][r] += xv * w0;
        a1[i][r] += xv * w1;
      }
    }
  };
  const int64_t K2 = K / 2;
  SpreadPrefetch spread(pf, pf_lines, K2);
  for (int64_t kk = 0; kk < K2; ++kk) {
    for (int i = 0; i < NP; ++i)  // 1 KiB ahead: the hardware prefetcher stops at pages
      __builtin_prefetch(p + i * K * kQNR + (2 * kk + 32) * kQNR, 0, 3);
    spread.step();
    step(2 * kk + 1);
    step(2 * kk);
  }
  if (K % 2) step(K - 1);
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < MR; ++r) ep[i].store(y + r * ldy + i * kQNR, a0[i][r], a1[i][r], ncols[i]);
}

template <typename B, typename Out>
using FmaTileFn = void (*)(const float*, int64_t, const int8_t*, int64_t, Out*, int64_t, const int64_t*,
                           const Epilogue<B>*, const void*, int64_t);
template <typename B, typename Out>
constexpr FmaTileFn<B, Out> kFmaTiles[9] = {
    nullptr, fma_tile<1, 1, B, Out>, fma_tile<2, 1, B, Out>, fma_tile<3, 1, B, Out>, fma_tile<4, 1, B, Out>,
    fma_tile<5, 1, B, Out>, fma_tile<6, 1, B, Out>, fma_tile<7, 1, B, Out>, fma_tile<8, 1, B, Out>};
// Panels per tile for a block of 1 or 2 rows: 8 accumulators, as a 4-row tile has.
constexpr int kWidePanels1 = 4, kWidePanels2 = 2;

inline void nothing() {}

template <typename B, typename Out>
void fma_run(const float* x, int64_t ldx, const int8_t* pp, const float* scale, const B* bias, int64_t M, int64_t K,
             int64_t P, int64_t N, Out* y) {
  const int64_t mr = kQMR;
  // Decode with one or two rows: units of np panels, run by one wide tile (or narrow ones for a short last group).
  const int64_t np = M == 1 ? kWidePanels1 : M == 2 ? kWidePanels2 : 1, groups = (P + np - 1) / np;
  run_units(M, groups, mr, kQMC, [&](int64_t m0, int64_t m1, int64_t g, int64_t next) {
    const int64_t j0 = g * np, j1 = std::min(P, j0 + np);
    // The next group's panels, which follow in memory, prefetched into L2 while this one runs; not for one row,
    // which the extra instructions made slower (Zen 5: its tile is bound by the conversions more than the memory).
    const int8_t* pf = next < 0 || M == 1 ? nullptr : pp + next * np * K * kQNR;
    const int64_t pf_lines = next < 0 ? 0 : (std::min(P, next * np + np) - next * np) * K * kQNR / 64;
    int64_t ncols[kWidePanels1];
    std::vector<Epilogue<B>> eps;
    eps.reserve(j1 - j0);
    for (int64_t j = j0; j < j1; ++j) {
      ncols[j - j0] = std::min(kQNR, N - j * kQNR);
      eps.emplace_back(scale + j * kQNR, bias ? bias + j * kQNR : nullptr, ncols[j - j0]);
    }
    const int8_t* p = pp + j0 * K * kQNR;
    Out* yb = y + j0 * kQNR;
    if (j1 - j0 == np && np == kWidePanels1) {
      fma_tile<1, kWidePanels1, B, Out>(x + m0 * ldx, ldx, p, K, yb + m0 * N, N, ncols, eps.data(), pf, pf_lines);
      return;
    }
    if (j1 - j0 == np && np == kWidePanels2) {
      fma_tile<2, kWidePanels2, B, Out>(x + m0 * ldx, ldx, p, K, yb + m0 * N, N, ncols, eps.data(), pf, pf_lines);
      return;
    }
    for (int64_t j = j0; j < j1; ++j)
      row_tiles(m0, m1, mr, j + 1 == j1 ? pf : nullptr, pf_lines,
                [&](int64_t m, int64_t rows, const PrefetchShare& share) {
                  kFmaTiles<B, Out>[rows](x + m * ldx, ldx, p + (j - j0) * K * kQNR, K, yb + m * N + (j - j0) * kQNR,
                                          N, ncols + (j - j0), eps.data() + (j - j0), share.from, share.lines);
                });
  }, nothing, nothing);
}

#ifdef PS_INT8_DP
constexpr int kDMR = 12;  // 24 accumulators, as the bf16 panel GEMM
constexpr int64_t kDMC = 240;

// pf: where to prefetch pf_lines cache lines (into L2) alongside; or null.
template <int MR, typename B, typename Out>
void dp_tile(const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t K2, Out* y, int64_t ldy, int64_t ncols,
             const Epilogue<B>& ep, const bf16_t* pf, int64_t pf_lines) {
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
  dp_accumulate<MR>(a0, a1, x, ldx, w, K2, pf, pf_lines);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) ep.store(y + r * ldy, (f32x16)a0[r], (f32x16)a1[r], ncols);
}

template <typename B, typename Out>
using DpTileFn = void (*)(const bf16_t*, int64_t, const bf16_t*, int64_t, Out*, int64_t, int64_t,
                          const Epilogue<B>&, const bf16_t*, int64_t);
template <typename B, typename Out>
constexpr DpTileFn<B, Out> kDpTiles[kDMR + 1] = {
    nullptr, dp_tile<1, B, Out>, dp_tile<2, B, Out>, dp_tile<3, B, Out>, dp_tile<4, B, Out>, dp_tile<5, B, Out>,
    dp_tile<6, B, Out>, dp_tile<7, B, Out>, dp_tile<8, B, Out>, dp_tile<9, B, Out>, dp_tile<10, B, Out>,
    dp_tile<11, B, Out>, dp_tile<12, B, Out>};

template <typename Out>
void dp_run(const bf16_t* x, int64_t ldx, const int8_t* pp, const float* scale, const bf16_t* bias, int64_t M,
            int64_t K, int64_t P, int64_t N, Out* y) {
  const int64_t K2 = K / 2;
  run_units(M, P, kDMR, kDMC, [&](int64_t m0, int64_t m1, int64_t j, int64_t next) {
    const bf16_t* w = widened_panel(pp + j * K * kQNR, K);
    const int64_t n0 = j * kQNR, ncols = std::min(kQNR, N - n0);
    const Epilogue<bf16_t> ep(scale + n0, bias ? bias + n0 : nullptr, ncols);
    const int8_t* pf = next < 0 ? nullptr : pp + next * K * kQNR;  // the next int8 panel, as the bf16 GEMM does
    row_tiles(m0, m1, kDMR, pf, K * kQNR / 64, [&](int64_t m, int64_t rows, const PrefetchShare& share) {
      kDpTiles<bf16_t, Out>[rows](x + m * ldx, ldx, w, K2, y + m * N + n0, N, ncols, ep, share.from, share.lines);
    });
  }, nothing, nothing);
}

#ifdef PS_AMX
constexpr int64_t kAmxMinRows = 4;

// bf16 rows on AMX: each panel widened as for vdpbf16ps (a step at a time where the unit is one row pair), then
// amx_rows over it.
template <typename Out>
void amx_run(const bf16_t* x, int64_t ldx, const int8_t* pp, const float* scale, const bf16_t* bias, int64_t M,
             int64_t K, int64_t P, int64_t N, Out* y) {
  const TileRows a(x, ldx, M, K);
  const TileConfig cfg(M);
  run_units(M, P, 2 * kAmxR, amx_block_rows(K), [&](int64_t m0, int64_t m1, int64_t j, int64_t next) {
    const int64_t n0 = j * kQNR, ncols = std::min(kQNR, N - n0);
    const Epilogue<bf16_t> ep(scale + n0, bias ? bias + n0 : nullptr, ncols);
    alignas(64) float c[2 * kAmxR][kAmxN];
    auto rows_over = [&](const auto& b) {
      for (int64_t m = m0; m < m1; m += 2 * kAmxR) {
        const int64_t rows = std::min(2 * kAmxR, m1 - m);
        amx_rows(a, b, m, rows, nullptr, c, nullptr);
        for (int64_t r = 0; r < rows; ++r) ep.store(y + (m + r) * N + n0, load16(c[r]), load16(c[r] + 16), ncols);
      }
    };
    if (m1 - m0 <= 2 * kAmxR) {
      rows_over(WidenedSteps(pp + j * K * kQNR, next < 0 ? nullptr : pp + next * K * kQNR, K));
      return;
    }
    rows_over(PanelSteps(widened_panel(pp + j * K * kQNR, K), K));
  }, [&] { _tile_loadconfig(&cfg); }, [] { _tile_release(); });
}
#endif

bool gemm_int8_dp_built() { return true; }
#else
bool gemm_int8_dp_built() { return false; }
#endif

// Rows of bf16 activations from which the vdpbf16ps path runs (below, widening each panel costs more than it saves;
// measured in docs/performance.md, "Weight-only int8").
constexpr int64_t kDpMinRows = 7;

void gemm_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor bias, torch::Tensor out,
               bool use_amx) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && out.dim() == 2 && packed.size(2) == kQNR);
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "fp32 or bf16 activations");
  TORCH_CHECK(packed.scalar_type() == torch::kChar && scale.scalar_type() == torch::kFloat);
  TORCH_CHECK(out.scalar_type() == x.scalar_type() || out.scalar_type() == torch::kFloat, "out: x's dtype or fp32");
  TORCH_CHECK(x.stride(1) == 1 && packed.is_contiguous() && out.is_contiguous() && scale.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), N = out.size(1);
  TORCH_CHECK(packed.size(1) == K && out.size(0) == M && N <= P * kQNR && N > (P - 1) * kQNR && scale.numel() == N);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == x.scalar_type()));
  if (M == 0) return;
  const int8_t* pp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const bool has_bias = bias.numel() > 0;
  if (x.scalar_type() == torch::kFloat) {
    const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
    fma_run(x.data_ptr<float>(), x.stride(0), pp, sp, bp, M, K, P, N, out.data_ptr<float>());
    return;
  }
  const bf16_t* xb = ptr<bf16_t>(x);
  const bf16_t* bp = has_bias ? ptr<bf16_t>(bias) : nullptr;
  const bool out_f32 = out.scalar_type() == torch::kFloat;
#ifdef PS_AMX
  if (use_amx && M >= kAmxMinRows && K % 2 == 0 && amx_usable()) {
    if (out_f32) amx_run(xb, x.stride(0), pp, sp, bp, M, K, P, N, out.data_ptr<float>());
    else amx_run(xb, x.stride(0), pp, sp, bp, M, K, P, N, mut_ptr<bf16_t>(out));
    return;
  }
#endif
#ifdef PS_INT8_DP
  if (M >= kDpMinRows && K % 2 == 0 && x.stride(0) % 2 == 0) {
    if (out_f32) dp_run(xb, x.stride(0), pp, sp, bp, M, K, P, N, out.data_ptr<float>());
    else dp_run(xb, x.stride(0), pp, sp, bp, M, K, P, N, mut_ptr<bf16_t>(out));
    return;
  }
#endif
  // bf16 rows widened once to fp32 (exact) for the FMA tiles.
  std::vector<float> xf(M * K);
  const int64_t ldx = x.stride(0);
  parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      for (int64_t k = 0; k < K; ++k) xf[m * K + k] = load1(xb + m * ldx + k);
  });
  if (out_f32) fma_run(xf.data(), K, pp, sp, bp, M, K, P, N, out.data_ptr<float>());
  else fma_run(xf.data(), K, pp, sp, bp, M, K, P, N, mut_ptr<bf16_t>(out));
}

}  // namespace ps
