// bf16 GEMM for CPU linears, y = x @ w.T (+ bias), on weights packed once into k-pair panels: AMX tiles where the
// CPU has them, else AVX512-BF16.
//
// A panel holds 32 output features as [K / 2, 32, 2]: for each pair of k, the 32 columns' two weights side by side,
// which is the operand layout of vdpbf16ps (16 fp32 lanes, each adding the dot product of a bf16 pair) and, 16
// pairs of k at a time, two B tiles of tdpbf16ps. On AVX512-BF16, a row tile of up to 12 rows keeps 24
// accumulators in zmm registers; per k pair it loads two weight vectors and, for each row, broadcasts that row's
// pair of activations into one vdpbf16ps per weight vector. On AMX, up to 32 rows (two A tiles) meet the panel's two
// B tiles 32 k at a time in four fp32 C tiles; fewer than 16 rows get short tiles. Threads claim chunks of (block
// of rows, panel) units as they go, blocks of rows first (their activations stay in L2), and run every row tile of
// a unit over the full K of its panel, so outputs are written once, rounded to bf16 (or kept fp32, for logits).
// Every output is summed in k order whatever tile or thread its row lands in, and one CPU takes one kernel for every
// row count, so a row's result is bitwise the same in any batch. Each thread prefetches its next panel into L2 while
// it runs the current one, each row tile taking an equal share. docs/performance.md has the rates against oneDNN.

#include "gemm_bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
namespace ps {

constexpr int64_t kBNR = 32, kBMR = 12, kBMC = 240;

inline __m512 widen(const bf16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store_out(bf16_t* y, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store_out(float* y, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(y, m, v); }

// y[r][0:ncols] = bias + sum_k x[r][k] * w[k] for rows r < MR of one panel; ncols <= 32. pf: where to prefetch
// pf_lines cache lines (into L2) alongside its reads; or null.
template <int MR, typename Out>
inline void bgemm_tile(const bf16_t* x, int64_t ldx, const bf16_t* p, int64_t K2, Out* y, int64_t ldy,
                       int64_t ncols, const bf16_t* bias, const bf16_t* pf, int64_t pf_lines) {
  __m512 a0[MR], a1[MR];
  auto cols = [](int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); };
  const __mmask16 m0 = cols(ncols), m1 = cols(ncols - 16);
  const __m512 b0 = bias ? widen(bias, m0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? widen(bias + 16, m1) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) { a0[r] = b0; a1[r] = b1; }
  dp_accumulate<MR>(a0, a1, x, ldx, p, K2, pf, pf_lines);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    store_out(y + r * ldy, a0[r], m0);
    if (m1) store_out(y + r * ldy + 16, a1[r], m1);
  }
}

template <typename Out>
using BTileFn = void (*)(const bf16_t*, int64_t, const bf16_t*, int64_t, Out*, int64_t, int64_t, const bf16_t*,
                         const bf16_t*, int64_t);
template <typename Out>
constexpr BTileFn<Out> kBTiles[kBMR + 1] = {
    nullptr, bgemm_tile<1, Out>, bgemm_tile<2, Out>, bgemm_tile<3, Out>, bgemm_tile<4, Out>, bgemm_tile<5, Out>,
    bgemm_tile<6, Out>, bgemm_tile<7, Out>, bgemm_tile<8, Out>, bgemm_tile<9, Out>, bgemm_tile<10, Out>,
    bgemm_tile<11, Out>, bgemm_tile<12, Out>};

template <typename Out>
void bgemm_run(const bf16_t* xp, int64_t ldx, const bf16_t* pp, int64_t M, int64_t K, int64_t P, int64_t N,
               const bf16_t* bp, Out* yp) {
  const int64_t K2 = K / 2;
  auto unit = [&](int64_t m0, int64_t m1, int64_t j, int64_t next) {
    const int64_t n0 = j * kBNR, ncols = std::min(kBNR, N - n0);
    const bf16_t* p = pp + j * K * kBNR;
    const bf16_t* pf = next < 0 ? nullptr : pp + next * K * kBNR;
    row_tiles(m0, m1, kBMR, pf, K * kBNR * int64_t(sizeof(bf16_t)) / 64,
              [&](int64_t m, int64_t mr, const PrefetchShare& share) {
                kBTiles<Out>[mr](xp + m * ldx, ldx, p, K2, yp + m * N + n0, N, ncols, bp ? bp + n0 : nullptr,
                                 share.from, share.lines);
              });
  };
  run_units(M, P, kBMR, kBMC, unit, [] {}, [] {});
}

#ifdef PS_AMX
template <typename Out>
void amx_run(const bf16_t* xp, int64_t ldx, const bf16_t* pp, int64_t M, int64_t K, int64_t P, int64_t N,
             const bf16_t* bp, Out* yp) {
  const TileRows a(xp, ldx, M, K);
  std::vector<float> bias(P * kBNR, 0.f);  // the C tiles start from it
  for (int64_t n = 0; bp != nullptr && n < N; ++n) bias[n] = load1(bp + n);
  const TileConfig cfg(M);
  auto unit = [&](int64_t m0, int64_t m1, int64_t j, int64_t next) {
    const int64_t n0 = j * kBNR, ncols = std::min(kBNR, N - n0);
    const PanelSteps b(pp + j * K * kBNR, K);
    const __mmask16 mask0 = ncols >= 16 ? 0xFFFF : (1u << ncols) - 1;
    const __mmask16 mask1 = ncols >= 32 ? 0xFFFF : ncols > 16 ? (1u << (ncols - 16)) - 1 : 0;
    alignas(64) float c[2 * kAmxR][kAmxN];
    for (int64_t m = m0; m < m1; m += 2 * kAmxR) {
      const int64_t rows = std::min(2 * kAmxR, m1 - m);
      // The first rows over a panel also fetch this thread's next panel into L2.
      amx_rows(a, b, m, rows, &bias[n0], c, m == m0 && next >= 0 ? pp + next * K * kBNR : nullptr);
      for (int64_t r = 0; r < rows; ++r) {
        store_out(yp + (m + r) * N + n0, _mm512_load_ps(c[r]), mask0);
        if (mask1) store_out(yp + (m + r) * N + n0 + 16, _mm512_load_ps(c[r] + 16), mask1);
      }
    }
  };
  run_units(M, P, 2 * kAmxR, amx_block_rows(K), unit, [&] { _tile_loadconfig(&cfg); }, [] { _tile_release(); });
}
#endif

// x [M, K] bf16 (rows may be strided), packed [P, K/2, 32, 2] bf16, bias [N] bf16 or empty, out [M, N] bf16 or
// fp32, contiguous.
void gemm_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out, bool use_amx) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && out.dim() == 2 && packed.size(2) == kBNR && packed.size(3) == 2);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16);
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kFloat, "bf16 or fp32 out");
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) % 2 == 0 && packed.is_contiguous() && out.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), N = out.size(1);
  TORCH_CHECK(K % 2 == 0 && packed.size(1) * 2 == K && out.size(0) == M && N <= P * kBNR && N > (P - 1) * kBNR);
  TORCH_CHECK(bias.numel() == 0 ||
              (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == torch::kBFloat16));
  const bf16_t* xp = ptr<bf16_t>(x);
  const bf16_t* pp = ptr<bf16_t>(packed);
  const bf16_t* bp = bias.numel() ? ptr<bf16_t>(bias) : nullptr;
  if (M == 0) return;
#ifdef PS_AMX
  if (use_amx && amx_usable()) {
    if (out.scalar_type() == torch::kFloat) amx_run(xp, x.stride(0), pp, M, K, P, N, bp, out.data_ptr<float>());
    else amx_run(xp, x.stride(0), pp, M, K, P, N, bp, mut_ptr<bf16_t>(out));
    return;
  }
#endif
  if (out.scalar_type() == torch::kFloat) bgemm_run(xp, x.stride(0), pp, M, K, P, N, bp, out.data_ptr<float>());
  else bgemm_run(xp, x.stride(0), pp, M, K, P, N, bp, mut_ptr<bf16_t>(out));
}

bool gemm_bf16_built() { return true; }

bool gemm_bf16_amx() {
#ifdef PS_AMX
  return amx_usable();
#else
  return false;
#endif
}

}  // namespace ps
#else
namespace ps {
void gemm_bf16(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, bool) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}
bool gemm_bf16_built() { return false; }
bool gemm_bf16_amx() { return false; }
}  // namespace ps
#endif
