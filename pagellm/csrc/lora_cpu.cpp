// LoRA deltas on the CPU: for each row of a step, its adapter's (x @ A^T) @ B^T * scale added
// into the projection's output columns, rows grouped by adapter slot.
//
// One entry point, called both by the Python layers (pagellm/lora/layers.py, through
// pagellm/kernels/lora_cpu.py) and by the C++ decoder loop (cpu_decoder.cpp, through its
// pointer), so a step that has adapter rows gives the same bits either way. Per row t of a
// group (slot s, rank r, scale c) and per output part (its adapters' A and B, its columns):
//
//   h[j]    = sum_k x[t, k] * At[s, k, j]           j < r, float32, k in order
//   y[t, n] = round(y[t, n] + c * sum_j h[j] * Bt[s, j, n])   j in order
//
// At [slots, K, R] and Bt [slots, R, N] are A and B transposed (the CPU layout of
// pagellm/lora/layers.py): both loops then run along contiguous memory, 16 lanes of j or n
// at once (the compiler vectorizes them; each lane's sum keeps its order, so the result
// does not depend on the vector width). Weights and activations share a kind: float32 or
// bf16 (rounded to nearest even as torch). A part whose slot has no adapter for it
// (`present[s]` 0) is skipped.

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "lora_cpu.h"

namespace {

constexpr int64_t kMaxRank = 512;  // h's floats on the stack

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline uint16_t float_to_bf16(float x) {  // round to nearest even, as torch
  if (std::isnan(x)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

template <typename T>
inline float as_float(T v) {
  if constexpr (sizeof(T) == 2) {
    return bf16_to_float(v);
  } else {
    return v;
  }
}

template <typename T>
inline void store_as(T* p, float v) {
  if constexpr (sizeof(T) == 2) {
    *p = float_to_bf16(v);
  } else {
    *p = v;
  }
}

// h[0..r) = x [K] @ At [K, R] (first r columns), k in order
template <typename T>
void shrink_scalar(const T* x, const T* at, int64_t K, int64_t R, int64_t r, float* h) {
  for (int64_t j = 0; j < r; ++j) h[j] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float xk = as_float(x[k]);
    for (int64_t j = 0; j < r; ++j) h[j] += xk * as_float(at[k * R + j]);
  }
}

// y [n0, cols) += scale * (h [r] @ Bt [r, cols]), j in order
template <typename T>
void expand_scalar(const float* h, const T* bt, int64_t r, int64_t n0, int64_t cols,
                   float scale, T* y) {
  for (int64_t n = n0; n < cols; ++n) {
    float acc = 0.f;
    for (int64_t j = 0; j < r; ++j) acc += h[j] * as_float(bt[j * cols + n]);
    store_as(y + n, as_float(y[n]) + scale * acc);
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// shrink_scalar's h, 16 columns a vector (R % 16 == 0; the columns past r, zeros in At, are
// summed too and left unused), as four partial sums over k mod 4 added at the end: four
// independent chains of multiply-adds (one chain waits on each add's latency)
template <typename T>
void shrink(const T* x, const T* at, int64_t K, int64_t R, int64_t r, float* h) {
  if (R % 16) return shrink_scalar(x, at, K, R, r, h);
  const int64_t K4 = K - K % 4;
  for (int64_t j0 = 0; j0 < r; j0 += 16) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (int64_t k = 0; k < K4; k += 4) {
      for (int u = 0; u < 4; ++u) {
        const __m512 xk = _mm512_set1_ps(as_float(x[k + u]));
        acc[u] = _mm512_fmadd_ps(xk, load16(at + (k + u) * R + j0), acc[u]);
      }
    }
    for (int64_t k = K4; k < K; ++k) {
      acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(as_float(x[k])), load16(at + k * R + j0), acc[0]);
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_storeu_ps(h + j0, sum);
  }
}

// expand_scalar's result, 64 columns at a time (16 a vector), the rest by expand_scalar
template <typename T>
void expand(const float* h, const T* bt, int64_t r, int64_t cols, float scale, T* y) {
  const int64_t n64 = cols - cols % 64;
  const __m512 vs = _mm512_set1_ps(scale);
  alignas(64) float out[64];
  for (int64_t n0 = 0; n0 < n64; n0 += 64) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (int64_t j = 0; j < r; ++j) {
      const __m512 hj = _mm512_set1_ps(h[j]);
      const T* b = bt + j * cols + n0;
      for (int i = 0; i < 4; ++i) acc[i] = _mm512_fmadd_ps(hj, load16(b + 16 * i), acc[i]);
    }
    for (int i = 0; i < 4; ++i) {
      _mm512_store_ps(out + 16 * i, _mm512_fmadd_ps(vs, acc[i], load16(y + n0 + 16 * i)));
    }
    for (int n = 0; n < 64; ++n) store_as(y + n0 + n, out[n]);
  }
  expand_scalar(h, bt, r, n64, cols, scale, y);
}
#else
template <typename T>
void shrink(const T* x, const T* at, int64_t K, int64_t R, int64_t r, float* h) {
  shrink_scalar(x, at, K, R, r, h);
}

template <typename T>
void expand(const float* h, const T* bt, int64_t r, int64_t cols, float scale, T* y) {
  expand_scalar(h, bt, r, 0, cols, scale, y);
}
#endif

template <typename T>
void add_rows(const T* x, int64_t K, T* y, int64_t ldy, const PagellmLoraPart* parts,
              int64_t num_parts, int64_t R, const int64_t* rows, const PagellmLoraGroup& g) {
  float h[kMaxRank];
  for (int64_t p = 0; p < num_parts; ++p) {
    const PagellmLoraPart& part = parts[p];
    if (!part.at || !part.present[g.slot]) continue;
    const T* at = static_cast<const T*>(part.at) + g.slot * K * R;
    const T* bt = static_cast<const T*>(part.bt) + g.slot * R * part.cols;
    for (int64_t i = g.first; i < g.first + g.count; ++i) {
      const int64_t t = rows[i];
      shrink(x + t * K, at, K, R, g.rank, h);
      expand(h, bt, g.rank, part.cols, g.scale, y + t * ldy + part.start);
    }
  }
}

}  // namespace

extern "C" {

// PagellmLoraFn (lora_cpu.h); 1 also for a rank over kMaxRank
int pagellm_lora_add(const void* x, int64_t K, void* y, int64_t ldy,
                     const PagellmLoraPart* parts, int64_t num_parts, int64_t R,
                     const int64_t* rows, const PagellmLoraGroup* groups, int64_t num_groups,
                     int kind) {
  for (int64_t gi = 0; gi < num_groups; ++gi) {
    const PagellmLoraGroup& g = groups[gi];
    if (g.rank > R || g.rank > kMaxRank) return 1;
    if (kind == 1) {
      add_rows(static_cast<const uint16_t*>(x), K, static_cast<uint16_t*>(y), ldy, parts,
               num_parts, R, rows, g);
    } else {
      add_rows(static_cast<const float*>(x), K, static_cast<float*>(y), ldy, parts, num_parts,
               R, rows, g);
    }
  }
  return 0;
}

}  // extern "C"
