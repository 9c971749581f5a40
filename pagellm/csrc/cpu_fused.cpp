// The small ops between a decoder layer's GEMMs, fused for the CPU: RMSNorm (+ the residual
// add), rotary embedding and SiLU-and-mul, each one pass over its rows.
//
// In eager torch each is 3-9 elementwise ops of a few microseconds of dispatch each, on
// rows that fit in L1: at decode batch sizes of a small model they cost as much as the
// attention (docs/notes.md). Rounding follows the torch path op by op, so a bfloat16
// result is the torch path's up to the order of RMSNorm's sum and the last bits of exp:
//
//   rms_norm      r = round(x + residual); n = round(r / sqrt(mean(r^2) + eps));
//                 out = round(w * n)
//   rotary        x1' = round(round(x1 cos) - round(x2 sin)),
//                 x2' = round(round(x2 cos) + round(x1 sin)); dims past `rot` copied
//   silu_and_mul  out = round(round(g / (1 + e^-g)) * u)
//
// (round: to the activation dtype, to nearest even as torch; a no-op in float32.) Rows are
// [T, heads, n] with strides in elements; the innermost dim is contiguous. A plain C entry
// point per op for ctypes (pagellm/kernels/cpu_fused.py checks shapes and strides), rows
// split over torch's threads with `at::parallel_for`.

// torch's ops round each product: no fused multiply-adds where the steps are its
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

enum Kind { F32 = 0, BF16 = 1 };

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

// element i of a row of `kind` as float / stored from float
inline float load(const void* row, int64_t i, int kind) {
  if (kind == F32) return static_cast<const float*>(row)[i];
  return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
}

inline void store(void* row, int64_t i, int kind, float x) {
  if (kind == F32) {
    static_cast<float*>(row)[i] = x;
  } else {
    static_cast<uint16_t*>(row)[i] = float_to_bf16(x);
  }
}

inline float round_to(float x, int kind) { return kind == F32 ? x : bf16_to_float(float_to_bf16(x)); }

inline size_t elem_size(int kind) { return kind == F32 ? 4 : 2; }

// row (t, h) of a [T, heads, n] tensor
inline char* row_at(void* base, int64_t t, int64_t h, int64_t st, int64_t sh, int kind) {
  return static_cast<char*>(base) + (t * st + h * sh) * int64_t(elem_size(kind));
}

#if defined(__AVX512F__)
// 16 elements as float32 / stored with torch's rounding (bf16: to nearest even, NaN kept)
inline __m512 load16(const void* p, int kind) {
  if (kind == F32) return _mm512_loadu_ps(p);
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512i bf16_bits(__m512 x) {  // the rounded bf16 of each lane, in its low 16 bits
#if defined(__AVX512BF16__)  // one instruction (nearest even; it treats denormals as zero)
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
#endif
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

inline __m512 round16(__m512 x, int kind) {
  if (kind == F32) return x;
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16));
}

inline void store16(void* p, int kind, __m512 x) {
  if (kind == F32) {
    _mm512_storeu_ps(p, x);
  } else {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(static_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
    return;
#endif
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
}

using pagellm::exp_ps;
#endif

struct Rows {  // a [T, heads, n] operand
  void* base;
  int64_t st, sh;
};

// r = x + residual (into res_out), out = w * norm(r); residual.base null: r = x
void rms_norm_row(const Rows& x, const Rows& res, const Rows& res_out, const Rows& out,
                  const void* w, int64_t t, int64_t h, int64_t n, float eps, int kind) {
  const char* xr = row_at(x.base, t, h, x.st, x.sh, kind);
  const char* ri = res.base ? row_at(res.base, t, h, res.st, res.sh, kind) : nullptr;
  char* rr = res.base ? row_at(res_out.base, t, h, res_out.st, res_out.sh, kind) : nullptr;
  char* o = row_at(out.base, t, h, out.st, out.sh, kind);
  const size_t es = elem_size(kind);
  const char* src = xr;
  int64_t i = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = load16(xr + i * es, kind);
    if (rr) {
      v = round16(_mm512_add_ps(v, load16(ri + i * es, kind)), kind);
      store16(rr + i * es, kind, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  double tail = 0.0;  // without AVX-512 the whole row: one float sum in order drifts (576
  for (; i < n; ++i) {  // terms: ~5e-7) where torch's vectorized sum does not
    float v = load(xr, i, kind);
    if (rr) {
      v = round_to(v + load(ri, i, kind), kind);
      store(rr, i, kind, v);
    }
    tail += double(v) * double(v);
  }
  ss = float(double(ss) + tail);
  if (rr) src = rr;
  const float inv = 1.f / std::sqrt(ss / float(n) + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) {
    const __m512 normed = round16(_mm512_mul_ps(load16(src + i * es, kind), vinv), kind);
    store16(o + i * es, kind, _mm512_mul_ps(load16(static_cast<const char*>(w) + i * es, kind), normed));
  }
#endif
  for (; i < n; ++i) store(o, i, kind, load(w, i, kind) * round_to(load(src, i, kind) * inv, kind));
}

// one (token, head) row of rotary: out = rotate(x) with cos | sin (`half` each) of the token
void rotary_row(const char* x, const char* cs, char* o, int64_t half, int64_t d, int kind) {
  const size_t es = elem_size(kind);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16(x + i * es, kind), x2 = load16(x + (i + half) * es, kind);
    const __m512 c = load16(cs + i * es, kind), s = load16(cs + (i + half) * es, kind);
    const __m512 a = round16(_mm512_mul_ps(x1, c), kind), b = round16(_mm512_mul_ps(x2, s), kind);
    const __m512 e = round16(_mm512_mul_ps(x2, c), kind), f = round16(_mm512_mul_ps(x1, s), kind);
    store16(o + i * es, kind, _mm512_sub_ps(a, b));
    store16(o + (i + half) * es, kind, _mm512_add_ps(e, f));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = load(x, i, kind), x2 = load(x, i + half, kind);
    const float c = load(cs, i, kind), s = load(cs, i + half, kind);
    store(o, i, kind, round_to(x1 * c, kind) - round_to(x2 * s, kind));
    store(o, i + half, kind, round_to(x2 * c, kind) + round_to(x1 * s, kind));
  }
  if (d > 2 * half) std::memcpy(o + 2 * half * es, x + 2 * half * es, (d - 2 * half) * es);
}

void silu_and_mul_row(const char* x, char* o, int64_t n, int kind) {
  const size_t es = elem_size(kind);
  const char* up = x + n * es;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = load16(x + i * es, kind);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = round16(_mm512_div_ps(g, _mm512_add_ps(one, e)), kind);
    store16(o + i * es, kind, _mm512_mul_ps(s, load16(up + i * es, kind)));
  }
#endif
  for (; i < n; ++i) {
    const float g = load(x, i, kind);
    const float s = round_to(g / (1.f + std::exp(-g)), kind);
    store(o, i, kind, s * load(up, i, kind));
  }
}

// rows (t, h) of T x heads split over torch's threads in tasks of 32768 elements at least
// (torch's own grain for elementwise ops: below it, waking threads costs more than it saves)
template <typename F>
void for_rows(int64_t tokens, int64_t heads, int64_t row_elems, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1));
  at::parallel_for(0, tokens * heads, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r / heads, r % heads);
  });
}

}  // namespace

// out = weight * norm(x [+ residual]); with a residual, res_out = x + residual (res_out may
// be residual itself). strides (token, head) of: x, residual, res_out, out
extern "C" void pagellm_rms_norm(void* out, void* res_out, const void* x, const void* residual,
                                 const void* weight, int64_t tokens, int64_t heads, int64_t n,
                                 const int64_t* strides, float eps, int kind) {
  const Rows xr{const_cast<void*>(x), strides[0], strides[1]};
  const Rows rr{const_cast<void*>(residual), strides[2], strides[3]};
  const Rows ro{res_out, strides[4], strides[5]};
  const Rows o{out, strides[6], strides[7]};
  for_rows(tokens, heads, n, [&](int64_t t, int64_t h) {
    rms_norm_row(xr, rr, ro, o, weight, t, h, n, eps, kind);
  });
}

// out = rotary(x) over the first 2 * half dims of each head (d in all); cos_sin [T, 2 * half]
// strides: x (token, head), out (token, head), cos_sin (token)
extern "C" void pagellm_rotary(void* out, const void* x, const void* cos_sin, int64_t tokens,
                               int64_t heads, int64_t half, int64_t d, const int64_t* strides,
                               int kind) {
  const size_t es = elem_size(kind);
  for_rows(tokens, heads, d, [&](int64_t t, int64_t h) {
    const char* xr = row_at(const_cast<void*>(x), t, h, strides[0], strides[1], kind);
    char* o = row_at(out, t, h, strides[2], strides[3], kind);
    const char* cs = static_cast<const char*>(cos_sin) + t * strides[4] * int64_t(es);
    rotary_row(xr, cs, o, half, d, kind);
  });
}

// out [T, n] = silu(x[:, :n]) * x[:, n:]; strides: x (token), out (token)
extern "C" void pagellm_silu_and_mul(void* out, const void* x, int64_t tokens, int64_t n,
                                     const int64_t* strides, int kind) {
  const size_t es = elem_size(kind);
  for_rows(tokens, 1, n, [&](int64_t t, int64_t) {
    const char* xr = static_cast<const char*>(x) + t * strides[0] * int64_t(es);
    silu_and_mul_row(xr, static_cast<char*>(out) + t * strides[1] * int64_t(es), n, kind);
  });
}
