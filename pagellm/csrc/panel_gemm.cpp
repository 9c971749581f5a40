// y = x @ W^T (+ bias) for bf16 x and W on CPUs with AVX512-BF16 (and the same for float32 x
// and W with AVX-512 FMAs, or AVX2 + FMA): the decode-sized GEMMs of a model, which stream
// every weight byte from memory once per step.
//
// At a few rows a decode step's GEMMs are bound by the weight bytes, not the arithmetic;
// oneDNN's bf16 kernel reads them at about half of what the memory delivers on the 2-core
// machines measured (docs/notes.md). This kernel reads W in the order it is stored,
// one pass per call:
//
//   W packed [ceil(N / 32), K / 2, 32, 2] bf16: panel p holds output rows 32 p .. 32 p + 31,
//   and for each pair of input columns (2 j, 2 j + 1) the 32 rows' two weights side by side,
//   so one 64-byte load is the 16-row x 2-column operand of `vdpbf16ps` (two of them a
//   panel's pair). Rows past N are zero. (cpu_panel_gemm.py packs it.)
//   x [M, K] bf16 (rows x_row elements apart), K even; y [M, N] bf16 (rows y_row apart);
//   bias [N] float32 or null.
//
// Every product of two bf16 values is exact in float32 and each output sums them in float32
// (pairwise inside the instruction, then along K), then rounds once to bf16: oneDNN's bf16
// kernel does the same up to summation order. float32: W packed [ceil(N / 32), K, 32], one
// FMA per weight and row of x, float32 sums (MKL's and oneDNN's arithmetic, another order).
// Without AVX-512 the float32 kernel runs on AVX2 + FMA (8-float vectors, 16 registers): up
// to 3 rows of x a pass over a panel's full lines, more rows over each half of it (16 output
// rows, one 64-byte line of each column) in passes of up to 6, tiles of 12 rows; every output
// is the same sum in the same order as on AVX-512, bit for bit.
// Up to 8 rows of x share a panel's loads (the
// panel stays in L2 for the next 8 rows of a larger x). Panels are split over ATen's thread
// pool (torch's OpenMP threads). A plain C entry point for ctypes.

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PAGELLM_AVX2_F32 1
#endif

namespace {

constexpr int64_t kPanel = 32;  // output rows per panel
constexpr int kTileRows = 8;    // rows of x per pass over a panel
constexpr int kTileRowsAvx2 = 12;  // float32 on AVX2: two passes of 6 rows a panel half
constexpr int64_t kChunkRows = 64;  // rows of x per pass over W

#if defined(__AVX512BF16__)

inline __m512i broadcast_pair(const uint16_t* p) {  // x[2 j], x[2 j + 1] in every lane
  int32_t pair;
  std::memcpy(&pair, p, 4);
  return _mm512_set1_epi32(pair);
}

// rows R of x (from x0) against one panel: y[r, 32 p .. 32 p + 31]
template <int R>
void panel_tile(const uint16_t* x0, int64_t x_row, int64_t pairs, const uint16_t* panel,
                const float* bias, uint16_t* y0, int64_t y_row, int64_t n0, int64_t N) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512i w0 = _mm512_loadu_si512(panel + j * 2 * kPanel);
    const __m512i w1 = _mm512_loadu_si512(panel + j * 2 * kPanel + kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512bh xj = (__m512bh)broadcast_pair(x0 + r * x_row + 2 * j);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)w0, xj);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)w1, xj);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t start = n0 + 16 * h;
    if (start >= N) break;
    const int64_t valid = N - start < 16 ? N - start : 16;
    const __mmask16 mask = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + start) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][h], b));
      _mm256_mask_storeu_epi16(y0 + r * y_row + start, mask, (__m256i)out);
    }
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*,
                        uint16_t*, int64_t, int64_t, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {
    nullptr,          panel_tile<1>, panel_tile<2>, panel_tile<3>, panel_tile<4>,
    panel_tile<5>, panel_tile<6>, panel_tile<7>, panel_tile<8>};

#endif

#if defined(__AVX512F__)

// float32: rows R of x against one panel [K, 32]
template <int R>
void panel_tile_f32(const float* x0, int64_t x_row, int64_t K, const float* panel,
                    const float* bias, float* y0, int64_t y_row, int64_t n0, int64_t N) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xk = _mm512_set1_ps(x0[r * x_row + k]);
      acc[r][0] = _mm512_fmadd_ps(w0, xk, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, xk, acc[r][1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t start = n0 + 16 * h;
    if (start >= N) break;
    const int64_t valid = N - start < 16 ? N - start : 16;
    const __mmask16 mask = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + start) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(y0 + r * y_row + start, mask, _mm512_add_ps(acc[r][h], b));
    }
  }
}

using TileF32Fn = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*,
                           int64_t, int64_t, int64_t);
constexpr TileF32Fn kTilesF32[kTileRows + 1] = {
    nullptr,              panel_tile_f32<1>, panel_tile_f32<2>, panel_tile_f32<3>,
    panel_tile_f32<4>, panel_tile_f32<5>, panel_tile_f32<6>, panel_tile_f32<7>,
    panel_tile_f32<8>};

#endif

#if defined(PAGELLM_AVX2_F32)

// Every loop over rows and vectors is unrolled by pragma: with the accumulators indexed by
// constants GCC keeps them in registers (else it also stores all of them every step, 2.5-3x
// slower).
#define PAGELLM_UNROLL _Pragma("GCC unroll 16")

// float32 on AVX2: rows R of x against V vectors (8 outputs each) of a panel [K, 32] from
// column `w` (V = 4: the whole panel, R <= 3; V = 2: one half, R <= 6: 12 accumulators)
template <int R, int V>
void pass_avx2(const float* x0, int64_t x_row, int64_t K, const float* w, const float* bias,
               float* y0, int64_t y_row, int64_t start, int64_t N) {
  __m256 acc[R][V];
  PAGELLM_UNROLL for (int r = 0; r < R; ++r) {
    PAGELLM_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    __m256 wk[V];
    PAGELLM_UNROLL for (int v = 0; v < V; ++v) wk[v] = _mm256_loadu_ps(w + k * kPanel + 8 * v);
    PAGELLM_UNROLL for (int r = 0; r < R; ++r) {
      const __m256 xk = _mm256_broadcast_ss(x0 + r * x_row + k);
      PAGELLM_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(wk[v], xk, acc[r][v]);
    }
  }
  const int64_t valid = N - start < 8 * V ? N - start : 8 * V;
  PAGELLM_UNROLL for (int r = 0; r < R; ++r) {
    alignas(32) float out[8 * V];
    PAGELLM_UNROLL for (int v = 0; v < V; ++v) _mm256_store_ps(out + 8 * v, acc[r][v]);
    float* y = y0 + r * y_row + start;
    for (int64_t i = 0; i < valid; ++i) y[i] = out[i] + (bias ? bias[start + i] : 0.0f);
  }
}

using PassFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*,
                        int64_t, int64_t, int64_t);
constexpr PassFn kPanelPasses[4] = {nullptr, pass_avx2<1, 4>, pass_avx2<2, 4>, pass_avx2<3, 4>};
constexpr PassFn kHalfPasses[7] = {nullptr,         pass_avx2<1, 2>, pass_avx2<2, 2>,
                                   pass_avx2<3, 2>, pass_avx2<4, 2>, pass_avx2<5, 2>,
                                   pass_avx2<6, 2>};

// rows (<= kTileRowsAvx2) of x against one panel
void panel_tile_f32_avx2(const float* x0, int64_t x_row, int64_t K, const float* panel,
                         const float* bias, float* y0, int64_t y_row, int64_t n0, int64_t N,
                         int rows) {
  if (rows <= 3) {  // decode sizes: one pass over the panel's full lines
    kPanelPasses[rows](x0, x_row, K, panel, bias, y0, y_row, n0, N);
    return;
  }
  for (int h = 0; h < 2 && n0 + 16 * h < N; ++h) {  // more rows: each half in passes of 6
    for (int r = 0; r < rows; r += 6) {
      const int take = rows - r < 6 ? rows - r : 6;
      kHalfPasses[take](x0 + r * x_row, x_row, K, panel + 16 * h, bias, y0 + r * y_row, y_row,
                        n0 + 16 * h, N);
    }
  }
}

#endif

// tile(p, m, rows) for every panel p and tile of up to kTileRows rows from m: the panels split
// over ATen's threads, x in passes of kChunkRows rows (each pass's rows stay in L2)
template <int TileRows = kTileRows, typename Tile>
void over_panels(int64_t M, int64_t N, const Tile& tile) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
    const int64_t m1 = M - m0 < kChunkRows ? M : m0 + kChunkRows;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t m = m0; m < m1; m += TileRows) {
          tile(p, m, m1 - m < TileRows ? int(m1 - m) : TileRows);
        }
      }
    });
  }
}

}  // namespace

extern "C" {

// 0: done; 1: bad arguments; 2: compiled without AVX-512 or AVX2 + FMA (float32) /
// AVX512-BF16 (bf16)
int pagellm_f32_gemm(const float* x, int64_t x_row, int64_t M, int64_t K, const float* w,
                     int64_t N, const float* bias, float* y, int64_t y_row) {
#if defined(__AVX512F__)
  if (M < 1 || N < 1 || K < 1 || x_row < K || y_row < N) return 1;
  over_panels(M, N, [&](int64_t p, int64_t m, int rows) {
    kTilesF32[rows](x + m * x_row, x_row, K, w + p * K * kPanel, bias, y + m * y_row, y_row,
                    p * kPanel, N);
  });
  return 0;
#elif defined(PAGELLM_AVX2_F32)
  if (M < 1 || N < 1 || K < 1 || x_row < K || y_row < N) return 1;
  over_panels<kTileRowsAvx2>(M, N, [&](int64_t p, int64_t m, int rows) {
    panel_tile_f32_avx2(x + m * x_row, x_row, K, w + p * K * kPanel, bias, y + m * y_row,
                        y_row, p * kPanel, N, rows);
  });
  return 0;
#else
  return 2;
#endif
}

int pagellm_bf16_gemm(const uint16_t* x, int64_t x_row, int64_t M, int64_t K,
                      const uint16_t* w, int64_t N, const float* bias, uint16_t* y,
                      int64_t y_row) {
#if defined(__AVX512BF16__)
  if (M < 1 || N < 1 || K < 2 || K % 2 || x_row < K || y_row < N) return 1;
  const int64_t pairs = K / 2;
  over_panels(M, N, [&](int64_t p, int64_t m, int rows) {
    kTiles[rows](x + m * x_row, x_row, pairs, w + p * pairs * 2 * kPanel, bias, y + m * y_row,
                 y_row, p * kPanel, N);
  });
  return 0;
#else
  return 2;
#endif
}

}  // extern "C"
