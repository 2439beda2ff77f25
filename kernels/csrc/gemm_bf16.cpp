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
// the first row tile over the current one runs. docs/performance.md has the rates against oneDNN.

#include "gemm_bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
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
// (into L2) as many bytes as the panel has, alongside its reads; or null.
template <int MR, typename Out>
inline void bgemm_tile(const bf16_t* x, int64_t ldx, const bf16_t* p, int64_t K2, Out* y, int64_t ldy,
                       int64_t ncols, const bf16_t* bias, const bf16_t* pf) {
  __m512 a0[MR], a1[MR];
  auto cols = [](int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); };
  const __mmask16 m0 = cols(ncols), m1 = cols(ncols - 16);
  const __m512 b0 = bias ? widen(bias, m0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? widen(bias + 16, m1) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) { a0[r] = b0; a1[r] = b1; }
  dp_accumulate<MR>(a0, a1, x, ldx, p, K2, [&](int64_t kk) __attribute__((always_inline)) {
    if (pf != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + kk * 2 * kBNR), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pf + kk * 2 * kBNR + kBNR), _MM_HINT_T1);
    }
  });
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    store_out(y + r * ldy, a0[r], m0);
    if (m1) store_out(y + r * ldy + 16, a1[r], m1);
  }
}

template <typename Out>
using BTileFn = void (*)(const bf16_t*, int64_t, const bf16_t*, int64_t, Out*, int64_t, int64_t, const bf16_t*,
                         const bf16_t*);
template <typename Out>
constexpr BTileFn<Out> kBTiles[kBMR + 1] = {
    nullptr, bgemm_tile<1, Out>, bgemm_tile<2, Out>, bgemm_tile<3, Out>, bgemm_tile<4, Out>, bgemm_tile<5, Out>,
    bgemm_tile<6, Out>, bgemm_tile<7, Out>, bgemm_tile<8, Out>, bgemm_tile<9, Out>, bgemm_tile<10, Out>,
    bgemm_tile<11, Out>, bgemm_tile<12, Out>};

// Rows of a block: tiles of 12, the remainder split into two near-equal tiles (13 rows: 7 + 6, not 12 + 1: a
// one-row tile runs on two dependency chains, latency-bound).
inline int64_t next_tile(int64_t left) {
  if (left <= kBMR) return left;
  if (left < 2 * kBMR) return (left + 1) / 2;
  return kBMR;
}

// Runs unit(m0, m1, j, pf) over every (block of rows [m0, m1), panel j) on torch's threads: blocks of rows first (a
// block's activations stay in L2 while its panels run), near-equal blocks of whole `granule`s of rows (so that units
// cost alike for the chunking), at most `block` rows each. pf: the panel this thread runs next, to prefetch into L2
// while the first rows over panel j run (null at the end). begin() and end() run once on each thread that works.
template <typename Unit, typename Begin, typename End>
void run_units(int64_t M, int64_t K, int64_t P, int64_t granule, int64_t block, const bf16_t* pp, Unit unit,
               Begin begin, End end) {
  const int64_t blocks = (M + block - 1) / block, mb = ((M + blocks - 1) / blocks + granule - 1) / granule * granule;
  const int64_t units = (M + mb - 1) / mb * P, threads = std::min<int64_t>(at::get_num_threads(), units);
  ChunkQueue queue(units, threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    begin();
    for (auto cur = queue.claim(); cur.first < units;) {
      // The next chunk is claimed now, so that its first panel can stream in while this chunk's last one runs.
      const auto next = queue.claim();
      for (int64_t u = cur.first; u < cur.second; ++u) {
        const int64_t v = u + 1 < cur.second ? u + 1 : next.first;
        unit(u / P * mb, std::min(M, u / P * mb + mb), u % P, v < units ? pp + v % P * K * kBNR : nullptr);
      }
      cur = next;
    }
    end();
  });
}

template <typename Out>
void bgemm_run(const bf16_t* xp, int64_t ldx, const bf16_t* pp, int64_t M, int64_t K, int64_t P, int64_t N,
               const bf16_t* bp, Out* yp) {
  const int64_t K2 = K / 2;
  auto unit = [&](int64_t m0, int64_t m1, int64_t j, const bf16_t* pf) {
    const int64_t n0 = j * kBNR, ncols = std::min(kBNR, N - n0);
    const bf16_t* p = pp + j * K * kBNR;
    for (int64_t m = m0; m < m1;) {
      const int64_t mr = next_tile(m1 - m);
      // The first tile over a panel also fetches this thread's next panel into L2.
      kBTiles<Out>[mr](xp + m * ldx, ldx, p, K2, yp + m * N + n0, N, ncols, bp ? bp + n0 : nullptr,
                       m == m0 ? pf : nullptr);
      m += mr;
    }
  };
  run_units(M, K, P, kBMR, kBMC, pp, unit, [] {}, [] {});
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX: tdpbf16ps multiplies a tile of 16 rows x 32 k (A) by one of 16 k pairs x 16 columns in k-pair layout (B)
// into 16 x 16 fp32 (C). A panel's [K/2, 32, 2] rows are two B tiles side by side (columns 0-15, 16-31, 128 bytes
// apart), so the same panels serve both kernels. Tiles: C 0-3 (two row groups x two column halves), A 4-5, B 6-7.
constexpr int64_t kTK = 32, kTR = 16, kAMC = 256;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per
// process; refused where the CPU or kernel lacks it.
bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Rows of x a tile reads: rows below `direct` in place, the others from a zero-padded copy of K rounded up to
// whole k steps (tiles read 16 rows of 32 k; where K is a whole number of k steps only the last partial group is
// copied, and nothing where there are fewer than 16 rows: their tiles are configured that short).
struct TileRows {
  const bf16_t* x;
  int64_t ldx, direct, Kp;
  std::vector<bf16_t> pad;
  TileRows(const bf16_t* x_, int64_t ldx_, int64_t M, int64_t K) : x(x_), ldx(ldx_) {
    Kp = (K + kTK - 1) / kTK * kTK;
    direct = K == Kp ? (M < kTR ? M : M / kTR * kTR) : 0;
    const int64_t Mp = (M + kTR - 1) / kTR * kTR;
    pad.assign((Mp - direct) * Kp, 0);
    for (int64_t m = direct; m < M; ++m) std::memcpy(&pad[(m - direct) * Kp], x + m * ldx, K * sizeof(bf16_t));
  }
  const bf16_t* row(int64_t m) const { return m < direct ? x + m * ldx : &pad[(m - direct) * Kp]; }
  int64_t stride(int64_t m) const { return (m < direct ? ldx : Kp) * int64_t(sizeof(bf16_t)); }
};

// Rows [m0, m1) (m0 a multiple of 16) of one panel: C = bias, then every k step of up to 32 rows' A tiles against
// the panel's two B tiles, in k order; then the valid rows and columns written out.
template <typename Out>
void amx_unit(const TileRows& a, const bf16_t* p, int64_t K, int64_t m0, int64_t m1, Out* y, int64_t ldy,
              int64_t ncols, const float* bias, const bf16_t* pf) {
  alignas(64) float c[2 * kTR][kBNR];
  alignas(64) bf16_t tail[kTR][2 * kBNR] = {};  // the last k step's pairs where K is not whole k steps
  const int64_t steps = a.Kp / kTK, whole = K / kTK, rest = (K - whole * kTK) / 2;
  if (rest) std::memcpy(tail, p + whole * kTR * 2 * kBNR, rest * 2 * kBNR * sizeof(bf16_t));
  const __mmask16 mask0 = ncols >= 16 ? 0xFFFF : (1u << ncols) - 1, mask1 = ncols > 16 ? (1u << (ncols - 16)) - 1 : 0;
  const __mmask16 m1full = ncols >= 32 ? 0xFFFF : mask1;
  for (int64_t m = m0; m < m1; m += 2 * kTR) {
    const bool two = m + kTR < m1;
    _tile_loadd(0, bias, 0); _tile_loadd(1, bias + 16, 0);
    if (two) { _tile_loadd(2, bias, 0); _tile_loadd(3, bias + 16, 0); }
    const bf16_t* a0 = a.row(m);
    const bf16_t* a1 = two ? a.row(m + kTR) : nullptr;
    const int64_t s0 = a.stride(m), s1 = two ? a.stride(m + kTR) : 0;
    for (int64_t t = 0; t < steps; ++t) {
      const bf16_t* b = t < whole ? p + t * kTR * 2 * kBNR : &tail[0][0];
      if (pf != nullptr && m == m0) {
        const char* q = reinterpret_cast<const char*>(pf + t * kTR * 2 * kBNR);
        for (int i = 0; i < kTR * 2 * kBNR * 2; i += 64) _mm_prefetch(q + i, _MM_HINT_T1);
      }
      _tile_loadd(6, b, 2 * kBNR * sizeof(bf16_t));
      _tile_loadd(7, b + kBNR, 2 * kBNR * sizeof(bf16_t));
      _tile_loadd(4, a0 + t * kTK, s0);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, a1 + t * kTK, s1);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, &c[0][0], kBNR * sizeof(float));
    _tile_stored(1, &c[0][16], kBNR * sizeof(float));
    if (two) { _tile_stored(2, &c[kTR][0], kBNR * sizeof(float)); _tile_stored(3, &c[kTR][16], kBNR * sizeof(float)); }
    for (int64_t r = 0, rows = std::min<int64_t>(2 * kTR, m1 - m); r < rows; ++r) {
      store_out(y + (m + r) * ldy, _mm512_load_ps(c[r]), mask0);
      if (m1full) store_out(y + (m + r) * ldy + 16, _mm512_load_ps(c[r] + 16), m1full);
    }
  }
}

template <typename Out>
void amx_run(const bf16_t* xp, int64_t ldx, const bf16_t* pp, int64_t M, int64_t K, int64_t P, int64_t N,
             const bf16_t* bp, Out* yp) {
  const TileRows a(xp, ldx, M, K);
  std::vector<float> bias(P * kBNR, 0.f);
  for (int64_t n = 0; bp != nullptr && n < N; ++n) bias[n] = load1(bp + n);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = kTR; cfg.colsb[t] = 64; }
  // Fewer than 16 rows (decode): short A and C tiles, whose multiplies take fewer cycles.
  if (M < kTR) cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = uint8_t(M);
  auto unit = [&](int64_t m0, int64_t m1, int64_t j, const bf16_t* pf) {
    const int64_t n0 = j * kBNR;
    amx_unit(a, pp + j * K * kBNR, K, m0, m1, yp + n0, N, std::min(kBNR, N - n0), &bias[n0], pf);
  };
  run_units(M, K, P, 2 * kTR, kAMC, pp, unit, [&] { _tile_loadconfig(&cfg); }, [] { _tile_release(); });
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
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
