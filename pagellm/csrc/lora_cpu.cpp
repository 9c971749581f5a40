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

#include <cmath>
#include <cstdint>
#include <cstring>

#include "lora_cpu.h"

namespace {

constexpr int64_t kChunk = 256;  // output columns summed at once (floats on the stack)
constexpr int64_t kMaxRank = 512;

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

// h[0..r) = x [K] @ At [K, R] (first r columns)
template <typename T>
void shrink(const T* x, const T* at, int64_t K, int64_t R, int64_t r, float* h) {
  for (int64_t j = 0; j < r; ++j) h[j] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float xk = as_float(x[k]);
    const T* a = at + k * R;
    for (int64_t j = 0; j < r; ++j) h[j] += xk * as_float(a[j]);
  }
}

// y [cols] += scale * (h [r] @ Bt [r, cols]), rounded into y's kind
template <typename T>
void expand(const float* h, const T* bt, int64_t r, int64_t cols, float scale, T* y) {
  float acc[kChunk];
  for (int64_t n0 = 0; n0 < cols; n0 += kChunk) {
    const int64_t n1 = cols - n0 < kChunk ? cols - n0 : kChunk;
    for (int64_t n = 0; n < n1; ++n) acc[n] = 0.f;
    for (int64_t j = 0; j < r; ++j) {
      const T* b = bt + j * cols + n0;
      const float hj = h[j];
      for (int64_t n = 0; n < n1; ++n) acc[n] += hj * as_float(b[n]);
    }
    for (int64_t n = 0; n < n1; ++n) {
      const float v = as_float(y[n0 + n]) + scale * acc[n];
      if constexpr (sizeof(T) == 2) {
        y[n0 + n] = float_to_bf16(v);
      } else {
        y[n0 + n] = v;
      }
    }
  }
}

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
