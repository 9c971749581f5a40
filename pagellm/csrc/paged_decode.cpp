// Paged attention on the CPU that reads the KV cache in place, one query row at a time.
//
// Each query row attends to the first lens[i] keys of its request through the block table:
// a decode to all of them, the rows of a prefill chunk causally (row at position t: t + 1
// keys; this step's keys are written to the cache first). No gathered copy of the keys and
// values is made. Work item = (row, KV head): the query heads sharing that KV head (GQA)
// are scored against each key row as it is read, then the values are mixed with the
// softmax weights.
//
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
//                           float32, bfloat16 or float8 (read through a 256-entry table)
//   q, out:                 [num_tokens, num_heads, head_dim] float32 or bfloat16
//   rows [n] int64:         the query rows of q / out
//   reqs [n] int64:         their requests (rows of block_table)
//   lens [n] int32:         the keys each row attends: its request's positions < lens[i]
//   block_table [R, max_blocks] int32
//
// scale multiplies q.k (an fp8 cache: times k_scale), v_scale the output; window W > 0:
// only the last W keys are read; soft_cap c > 0: scores become c * tanh(score / c); sinks
// (gpt-oss, a float per query head, or null): exp(sink) joins each softmax's denominator.
// Accumulation is float32 throughout; with AVX-512 (head_dim 64 / 128 / 256) the keys go 16
// at a time through vector code, with AVX2 + FMA (head_dim 32 / 64 / 128 / 256) 8 at a time,
// otherwise one at a time. Items are taken longest first
// from a shared counter (the caller passes rows sorted by length), so threads finish
// together.
//
// A plain C entry point for ctypes (pagellm/attention/cpu_decode.py checks shapes, dtypes
// and strides): only ATen's thread pool is used from torch, so this compiles in about a
// second. Built with -fopenmp, its `at::parallel_for` runs on torch's OpenMP runtime (the
// libgomp torch has loaded) with torch's thread count.

#include <ATen/Parallel.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PAGELLM_AVX2_ATTENTION 1
#endif

#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Kind { F32 = 0, BF16 = 1, FP8 = 2 };  // element kinds of q / out and of the caches

struct Problem {
  const char* q;
  char* out;
  const char* k_cache;
  const char* v_cache;
  const int32_t* block_table;
  const int64_t* rows;
  const int64_t* reqs;
  const int32_t* lens;
  const float* fp8_table;  // FP8: the cache's 256 byte values as float
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;  // elements
  int64_t c_stride_b, c_stride_s, c_stride_h;  // elements of the cache
  int64_t bt_stride;
  int num_heads, num_kv_heads, head_dim, block_size, window;
  int q_kind, c_kind;
  float scale, v_scale, soft_cap;
  const float* sinks;  // [num_heads] sink logits (gpt-oss), or null
};

// the softmax's max over the scores and query head `head`'s sink logit (if any)
inline float with_sink(const Problem& p, int head, float max_s) {
  return p.sinks ? std::max(max_s, p.sinks[head]) : max_s;
}

// the sink's share of the softmax's denominator: exp(sink - max), 0 without sinks
inline float sink_weight(const Problem& p, int head, float max_s) {
  return p.sinks ? std::exp(p.sinks[head] - max_s) : 0.f;
}

inline size_t elem_size(int kind) { return kind == F32 ? 4 : kind == BF16 ? 2 : 1; }

// one row (d elements) as float32
inline void to_float(const void* src, int kind, int d, const float* table, float* dst) {
  if (kind == F32) {
    std::memcpy(dst, src, d * sizeof(float));
  } else if (kind == BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    uint32_t* o = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
    for (int i = 0; i < d; ++i) o[i] = uint32_t(s[i]) << 16;
  } else {
    const uint8_t* s = static_cast<const uint8_t*>(src);
    for (int i = 0; i < d; ++i) dst[i] = table[s[i]];
  }
}

inline uint16_t to_bf16(float x) {  // round to nearest even, as torch
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (std::isnan(x)) return 0x7fc0;
  return uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

inline float dot(const float* a, const float* b, int d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) y[i] += w * x[i];
}

// row `i`'s query heads on KV head `h`, one element at a time (any head_dim, any CPU);
// buf: the thread's scratch
void attend_scalar(const Problem& p, int64_t i, int h, std::vector<float>& buf) {
  const int d = p.head_dim;
  const int g = p.num_heads / p.num_kv_heads;  // query heads of this KV head
  const int64_t req = p.reqs[i], row = p.rows[i];
  const int len = p.lens[i];
  const int first = p.window > 0 ? std::max(0, len - p.window) : 0;
  const int n = len - first;  // keys attended
  buf.resize(size_t(g) * (2 * d + n + 2) + d);
  float* qf = buf.data();  // [g, d] queries times scale
  float* acc = qf + size_t(g) * d;  // [g, d] weighted values
  float* row_f = acc + size_t(g) * d;  // [d] one K or V row
  float* max_s = row_f + d;  // [g]
  float* sum = max_s + g;  // [g]
  float* scores = sum + g;  // [g, n]
  const size_t q_elem = elem_size(p.q_kind), c_elem = elem_size(p.c_kind);
  for (int j = 0; j < g; ++j) {
    const int64_t off = row * p.q_stride_t + int64_t(h * g + j) * p.q_stride_h;
    float* qj = qf + size_t(j) * d;
    to_float(p.q + off * q_elem, p.q_kind, d, nullptr, qj);
    for (int e = 0; e < d; ++e) qj[e] *= p.scale;
    max_s[j] = -INFINITY;
    sum[j] = 0.f;
  }
  const int32_t* table = p.block_table + req * p.bt_stride;
  auto cache_row = [&](const char* cache, int pos) {
    const int64_t block = table[pos / p.block_size];
    const int64_t slot = pos % p.block_size;
    return cache + (block * p.c_stride_b + slot * p.c_stride_s + h * p.c_stride_h) * c_elem;
  };
  for (int t = 0; t < n; ++t) {  // scores: each key row read once for the g queries
    to_float(cache_row(p.k_cache, first + t), p.c_kind, d, p.fp8_table, row_f);
    for (int j = 0; j < g; ++j) {
      float s = dot(qf + size_t(j) * d, row_f, d);
      if (p.soft_cap > 0.f) s = p.soft_cap * std::tanh(s / p.soft_cap);
      scores[size_t(j) * n + t] = s;
      max_s[j] = std::max(max_s[j], s);
    }
  }
  for (int j = 0; j < g; ++j) {
    float* s = scores + size_t(j) * n;
    max_s[j] = with_sink(p, h * g + j, max_s[j]);
    for (int t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - max_s[j]);
      sum[j] += s[t];
    }
    sum[j] += sink_weight(p, h * g + j, max_s[j]);
  }
  std::fill(acc, acc + size_t(g) * d, 0.f);
  for (int t = 0; t < n; ++t) {  // values, weighted: each row read once
    to_float(cache_row(p.v_cache, first + t), p.c_kind, d, p.fp8_table, row_f);
    for (int j = 0; j < g; ++j) axpy(scores[size_t(j) * n + t], row_f, acc + size_t(j) * d, d);
  }
  for (int j = 0; j < g; ++j) {
    const float norm = p.v_scale / sum[j];
    const int64_t off = row * p.o_stride_t + int64_t(h * g + j) * p.o_stride_h;
    const float* a = acc + size_t(j) * d;
    if (p.q_kind == F32) {
      float* o = reinterpret_cast<float*>(p.out) + off;
      for (int e = 0; e < d; ++e) o[e] = a[e] * norm;
    } else {
      uint16_t* o = reinterpret_cast<uint16_t*>(p.out) + off;
      for (int e = 0; e < d; ++e) o[e] = to_bf16(a[e] * norm);
    }
  }
}

#if defined(__AVX512F__) || defined(PAGELLM_AVX2_ATTENTION)
// One work item of the vector paths: the keys row i attends on KV head h (a window's last
// ones), `buf` laid out for chunks of `lanes` keys, and the byte offset of each key's row in
// the K (and V) cache, walking the block table
struct Item {
  int g, n, n_pad;  // query heads of this KV head; keys; keys rounded up to whole chunks
  int64_t row;  // of q and out
  float* qf;  // [g, d] queries times scale
  float* tile;  // [lanes, d] K rows as float32
  float* scores;  // [g, n_pad], then the softmax weights
  float* sums;  // [g] of the weights
  int64_t* offs;  // [n] rows' byte offsets
};

Item item(const Problem& p, int64_t i, int h, int d, int lanes, size_t c_elem,
          std::vector<float>& buf) {
  Item it;
  it.g = p.num_heads / p.num_kv_heads;
  it.row = p.rows[i];
  const int len = p.lens[i];
  const int first = p.window > 0 ? std::max(0, len - p.window) : 0;
  it.n = len - first;
  it.n_pad = (it.n + lanes - 1) / lanes * lanes;
  const size_t g = it.g;
  buf.resize(g * (d + it.n_pad + 1) + lanes * size_t(d) + 2 * size_t(it.n) + 2);
  it.qf = buf.data();
  it.tile = it.qf + g * d;
  it.scores = it.tile + lanes * size_t(d);
  it.sums = it.scores + g * it.n_pad;
  it.offs = reinterpret_cast<int64_t*>(it.sums + g + (g & 1));  // 8-byte aligned
  const int32_t* table = p.block_table + p.reqs[i] * p.bt_stride;
  int b = first / p.block_size, slot = first % p.block_size;
  for (int t = 0; t < it.n; ++t) {
    it.offs[t] = (table[b] * p.c_stride_b + slot * p.c_stride_s + h * p.c_stride_h) * c_elem;
    if (++slot == p.block_size) slot = 0, ++b;
  }
  return it;
}
#endif

#if defined(__AVX512F__)
// AVX-512: keys 16 at a time. K rows become float32 in a [16, d] tile, each query head
// scores the tile (16 FMA chains, summed across lanes by one transpose), the exponentials
// are computed 16 lanes at a time, and values are accumulated in float32. Same arithmetic
// as attend_scalar up to the order of the sums (and exp_ps's last bits); head_dim 64, 128
// or 256 (`attend` picks the path). With AVX512-BF16, bf16 queries on a bf16 cache take
// bf16 dot products instead (`score_bf16`, `mix_values_bf16`).

// 16 rows (keys) of up to 16 elements each -> lane t holds the sum of a[t]
inline __m512 sum_rows16(const __m512* a) {
  __m512 c[8], d[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: sums of pairs of rows 2i, 2i + 1
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: rows 4i .. 4i + 3, that lane's sum
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(3, 1, 3, 1)));
}

using pagellm::exp_ps;  // of the scores minus their max: x <= 0

// 16 elements of a row (float32, bfloat16 or fp8 through `table`) as float32
inline __m512 load16(const char* src, int kind, const float* table) {
  if (kind == F32) return _mm512_loadu_ps(reinterpret_cast<const float*>(src));
  if (kind == BF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), table, 4);
}

// the weighted values of NB query heads j0 .. j0 + NB - 1, accumulated in registers
template <int DV, int CK, int NB>
void mix_values(const Problem& p, const int64_t* offs, int n, const float* weights, int n16,
                __m512 (*acc)[DV]) {
  __m512 a[NB][DV];
  for (int jj = 0; jj < NB; ++jj)
    for (int e = 0; e < DV; ++e) a[jj][e] = _mm512_setzero_ps();
  const int v_bytes = 16 * int(elem_size(CK));
  for (int t = 0; t < n; ++t) {
    const char* v = p.v_cache + offs[t];
    __m512 vr[DV];
    for (int e = 0; e < DV; ++e) vr[e] = load16(v + e * v_bytes, CK, p.fp8_table);
    for (int jj = 0; jj < NB; ++jj) {
      const __m512 w = _mm512_set1_ps(weights[size_t(jj) * n16 + t]);
      for (int e = 0; e < DV; ++e) a[jj][e] = _mm512_fmadd_ps(w, vr[e], a[jj][e]);
    }
  }
  for (int jj = 0; jj < NB; ++jj)
    for (int e = 0; e < DV; ++e) acc[jj][e] = a[jj][e];
}

#if defined(__AVX512BF16__)
// bf16 queries and a bf16 cache (a bf16 model): vdpbf16ps multiplies 32 bf16 pairs into 16
// float32 lanes, so neither keys nor values are widened. Products are exact and summed in
// float32, as above; the softmax weights are rounded to bf16 for the values, as torch's
// bf16 attention kernels round them, and their sum is of the rounded weights.
constexpr bool kBf16Dots = true;

// scores of g query heads against n keys, straight from the cache rows (no float32 tile)
template <int DV>
void score_bf16(const Problem& p, const int64_t* offs, int n, int64_t row, int h, int g,
                float* scores, int n16) {
  constexpr int DB = DV / 2;  // 32-element bf16 vectors a row
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int j = 0; j < g; ++j) {
    const char* qrow = p.q + (row * p.q_stride_t + int64_t(h * g + j) * p.q_stride_h) * 2;
    __m512bh qv[DB];
    for (int e = 0; e < DB; ++e) qv[e] = (__m512bh)_mm512_loadu_si512(qrow + e * 64);
    for (int t0 = 0; t0 < n; t0 += 16) {
      const int m = std::min(16, n - t0);  // lanes past m re-read key n - 1: discarded
      __m512 a[16];
      for (int t = 0; t < 16; ++t) {
        const char* k = p.k_cache + offs[t0 + std::min(t, m - 1)];
        a[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k));
        for (int e = 1; e < DB; ++e) {
          a[t] = _mm512_dpbf16_ps(a[t], qv[e], (__m512bh)_mm512_loadu_si512(k + e * 64));
        }
      }
      _mm512_storeu_ps(scores + size_t(j) * n16 + t0, _mm512_mul_ps(sum_rows16(a), scale));
    }
  }
}

inline __m512 round_bf16(__m512 x) {  // to the nearest bf16, as float32
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the weighted values of NB query heads, two keys per vdpbf16ps: rows t and t + 1
// interleaved element by element (unpacklo / unpackhi of each 128-bit lane), which permutes
// the output elements; the permutation is undone once at the end
template <int DV, int NB>
void mix_values_bf16(const Problem& p, const int64_t* offs, int n, const float* weights,
                     int n16, __m512 (*acc)[DV]) {
  constexpr int DB = DV / 2;
  __m512 lo[NB][DB], hi[NB][DB];
  for (int jj = 0; jj < NB; ++jj)
    for (int e = 0; e < DB; ++e) lo[jj][e] = hi[jj][e] = _mm512_setzero_ps();
  for (int t = 0; t < n; t += 2) {
    const bool pair = t + 1 < n;  // an odd last key pairs with itself at weight 0
    const char* v0 = p.v_cache + offs[t];
    const char* v1 = p.v_cache + offs[pair ? t + 1 : t];
    __m512i x[DB], y[DB];
    for (int e = 0; e < DB; ++e) {
      const __m512i r0 = _mm512_loadu_si512(v0 + e * 64), r1 = _mm512_loadu_si512(v1 + e * 64);
      x[e] = _mm512_unpacklo_epi16(r0, r1);
      y[e] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int jj = 0; jj < NB; ++jj) {
      const float* w = weights + size_t(jj) * n16 + t;  // already bf16 values
      uint32_t w0, w1 = 0;
      std::memcpy(&w0, w, 4);
      if (pair) std::memcpy(&w1, w + 1, 4);
      const __m512bh wp = (__m512bh)_mm512_set1_epi32(int((w0 >> 16) | (w1 & 0xffff0000u)));
      for (int e = 0; e < DB; ++e) {
        lo[jj][e] = _mm512_dpbf16_ps(lo[jj][e], wp, (__m512bh)x[e]);
        hi[jj][e] = _mm512_dpbf16_ps(hi[jj][e], wp, (__m512bh)y[e]);
      }
    }
  }
  // lo holds elements 8l + 0..3 of each 128-bit lane l, hi 8l + 4..7 (of each 32)
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  for (int jj = 0; jj < NB; ++jj) {
    for (int e = 0; e < DB; ++e) {
      acc[jj][2 * e] = _mm512_permutex2var_ps(lo[jj][e], first, hi[jj][e]);
      acc[jj][2 * e + 1] = _mm512_permutex2var_ps(lo[jj][e], second, hi[jj][e]);
    }
  }
}
#else
constexpr bool kBf16Dots = false;
#endif

// scores of g query heads against n keys: K rows become float32 in a [16, d] tile, 16 keys
// at a time, and each query head scores the tile (16 FMA chains, one transpose to sum)
template <int DV, int CK>
void score_tile(const Problem& p, const int64_t* offs, int n, const float* qf, int g,
                float* tile, float* scores, int n16) {
  constexpr int d = DV * 16;
  const int v_bytes = 16 * int(elem_size(CK));  // of one vector's elements
  for (int t0 = 0; t0 < n; t0 += 16) {
    const int m = std::min(16, n - t0);  // rows past m keep stale values: lanes discarded
    for (int t = 0; t < m; ++t) {
      const char* k = p.k_cache + offs[t0 + t];
      for (int e = 0; e < DV; ++e) {
        _mm512_storeu_ps(tile + t * d + e * 16, load16(k + e * v_bytes, CK, p.fp8_table));
      }
    }
    for (int j = 0; j < g; ++j) {
      __m512 a[16];
      for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
      for (int e = 0; e < DV; ++e) {
        const __m512 qv = _mm512_loadu_ps(qf + size_t(j) * d + e * 16);
        for (int t = 0; t < 16; ++t) {
          a[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(tile + t * d + e * 16), a[t]);
        }
      }
      _mm512_storeu_ps(scores + size_t(j) * n16 + t0, sum_rows16(a));
    }
  }
}

// DV = head_dim / 16 vectors a row, CK the cache's element kind. Accumulators stay in
// registers: 16 score chains a query head, and the values of up to 16 / DV query heads at a
// time (more heads re-read the values, from cache).
template <int DV, int CK>
void attend_avx512(const Problem& p, int64_t i, int h, std::vector<float>& buf) {
  constexpr int d = DV * 16;
  constexpr int HB = DV >= 16 ? 1 : 16 / DV < 4 ? 16 / DV : 4;
  const bool bf16_dots = kBf16Dots && CK == BF16 && p.q_kind == BF16 && DV % 2 == 0;
  const size_t q_elem = elem_size(p.q_kind), c_elem = elem_size(CK);
  const Item it = item(p, i, h, d, 16, c_elem, buf);
  const int g = it.g, n = it.n, n16 = it.n_pad;
  const int64_t row = it.row;
  float *qf = it.qf, *tile = it.tile, *scores = it.scores, *sums = it.sums;
  const int64_t* offs = it.offs;
#if defined(__AVX512BF16__)
  if (bf16_dots) score_bf16<DV>(p, offs, n, row, h, g, scores, n16);
#endif
  if (!bf16_dots) {
    for (int j = 0; j < g; ++j) {
      const int64_t off = (row * p.q_stride_t + int64_t(h * g + j) * p.q_stride_h) * q_elem;
      for (int e = 0; e < DV; ++e) {
        const __m512 x = load16(p.q + off + e * 16 * q_elem, p.q_kind, nullptr);
        _mm512_storeu_ps(qf + size_t(j) * d + e * 16, _mm512_mul_ps(x, _mm512_set1_ps(p.scale)));
      }
    }
    score_tile<DV, CK>(p, offs, n, qf, g, tile, scores, n16);
  }
  for (int j = 0; j < g; ++j) {  // softmax weights (unnormalized), 16 at a time
    float* s = scores + size_t(j) * n16;
    if (p.soft_cap > 0.f) {
      for (int t = 0; t < n; ++t) s[t] = p.soft_cap * std::tanh(s[t] / p.soft_cap);
    }
    for (int t = n; t < n16; ++t) s[t] = -INFINITY;  // the last chunk's discarded lanes
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n16; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
    const float top = with_sink(p, h * g + j, _mm512_reduce_max_ps(mx));
    const __m512 max_s = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < n16; t += 16) {
      __m512 w = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), max_s));  // 0 past n
#if defined(__AVX512BF16__)
      if (bf16_dots) w = round_bf16(w);
#endif
      _mm512_storeu_ps(s + t, w);
      sum = _mm512_add_ps(sum, w);
    }
    sums[j] = _mm512_reduce_add_ps(sum) + sink_weight(p, h * g + j, top);
  }
  for (int j0 = 0; j0 < g; j0 += HB) {  // values, weighted, HB query heads at a time
    const int hb = std::min(HB, g - j0);
    __m512 acc[HB][DV];
    const float* w = scores + size_t(j0) * n16;
    if (bf16_dots) {
#if defined(__AVX512BF16__)
      if constexpr (DV % 2 == 0) {
        switch (hb) {
          case 1: mix_values_bf16<DV, 1>(p, offs, n, w, n16, acc); break;
          case 2: if constexpr (HB >= 2) mix_values_bf16<DV, 2>(p, offs, n, w, n16, acc); break;
          case 3: if constexpr (HB >= 3) mix_values_bf16<DV, 3>(p, offs, n, w, n16, acc); break;
          default: if constexpr (HB >= 4) mix_values_bf16<DV, 4>(p, offs, n, w, n16, acc);
        }
      }
#endif
    } else {
      switch (hb) {
        case 1: mix_values<DV, CK, 1>(p, offs, n, w, n16, acc); break;
        case 2: if constexpr (HB >= 2) mix_values<DV, CK, 2>(p, offs, n, w, n16, acc); break;
        case 3: if constexpr (HB >= 3) mix_values<DV, CK, 3>(p, offs, n, w, n16, acc); break;
        default: if constexpr (HB >= 4) mix_values<DV, CK, 4>(p, offs, n, w, n16, acc);
      }
    }
    for (int jj = 0; jj < hb; ++jj) {
      const int j = j0 + jj;
      const __m512 norm = _mm512_set1_ps(p.v_scale / sums[j]);
      const int64_t off = row * p.o_stride_t + int64_t(h * g + j) * p.o_stride_h;
      for (int e = 0; e < DV; ++e) {
        const __m512 o = _mm512_mul_ps(acc[jj][e], norm);
        if (p.q_kind == F32) {
          _mm512_storeu_ps(reinterpret_cast<float*>(p.out) + off + e * 16, o);
        } else {
          alignas(64) float tmp[16];
          _mm512_store_ps(tmp, o);
          uint16_t* dst = reinterpret_cast<uint16_t*>(p.out) + off + e * 16;
          for (int x = 0; x < 16; ++x) dst[x] = to_bf16(tmp[x]);
        }
      }
    }
  }
}
#endif

#if defined(PAGELLM_AVX2_ATTENTION)
// AVX2 + FMA: attend_avx512's steps on 8-float vectors, keys 8 at a time. K rows become
// float32 in an [8, d] tile, each query head scores it (8 FMA chains, summed across lanes by
// one transpose), the exponentials 8 lanes at a time, the values accumulated in registers.
// Same arithmetic as attend_scalar up to the order of the sums (and exp_ps's last bits).
#define PAGELLM_UNROLL _Pragma("GCC unroll 16")  // constant indices: accumulators in registers

using pagellm::exp_ps;  // of the scores minus their max: x <= 0

// 8 rows (keys) of 8 elements each -> lane t holds the sum of a[t]
inline __m256 sum_rows8(const __m256* a) {
  const __m256 c0 = _mm256_hadd_ps(a[0], a[1]), c1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 c2 = _mm256_hadd_ps(a[4], a[5]), c3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 d0 = _mm256_hadd_ps(c0, c1), d1 = _mm256_hadd_ps(c2, c3);  // 128-bit halves
  return _mm256_add_ps(_mm256_permute2f128_ps(d0, d1, 0x20), _mm256_permute2f128_ps(d0, d1, 0x31));
}

// 8 elements of a row (float32, bfloat16 or fp8 through `table`) as float32
inline __m256 load8(const char* src, int kind, const float* table) {
  if (kind == F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(src));
  if (kind == BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  return _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(b), 4);
}

inline float reduce_add8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline float reduce_max8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// DV = head_dim / 8 vectors a row, CK the cache's element kind
template <int DV, int CK>
void attend_avx2(const Problem& p, int64_t i, int h, std::vector<float>& buf) {
  constexpr int d = DV * 8;
  const size_t q_elem = elem_size(p.q_kind), c_elem = elem_size(CK);
  const int v_bytes = 8 * int(elem_size(CK));  // of one vector's elements
  const Item it = item(p, i, h, d, 8, c_elem, buf);
  const int g = it.g, n = it.n, n8 = it.n_pad;
  const int64_t row = it.row;
  float *qf = it.qf, *tile = it.tile, *scores = it.scores, *sums = it.sums;
  const int64_t* offs = it.offs;
  for (int j = 0; j < g; ++j) {
    const int64_t off = (row * p.q_stride_t + int64_t(h * g + j) * p.q_stride_h) * q_elem;
    for (int e = 0; e < DV; ++e) {
      const __m256 x = load8(p.q + off + e * 8 * q_elem, p.q_kind, nullptr);
      _mm256_storeu_ps(qf + size_t(j) * d + e * 8, _mm256_mul_ps(x, _mm256_set1_ps(p.scale)));
    }
  }
  for (int t0 = 0; t0 < n; t0 += 8) {  // scores, 8 keys at a time
    const int m = std::min(8, n - t0);  // rows past m keep stale values: lanes discarded
    for (int t = 0; t < m; ++t) {
      const char* k = p.k_cache + offs[t0 + t];
      for (int e = 0; e < DV; ++e) {
        _mm256_storeu_ps(tile + t * d + e * 8, load8(k + e * v_bytes, CK, p.fp8_table));
      }
    }
    for (int j = 0; j < g; ++j) {
      __m256 a[8];
      PAGELLM_UNROLL for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
      for (int e = 0; e < DV; ++e) {
        const __m256 qv = _mm256_loadu_ps(qf + size_t(j) * d + e * 8);
        PAGELLM_UNROLL for (int t = 0; t < 8; ++t) {
          a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(tile + t * d + e * 8), a[t]);
        }
      }
      _mm256_storeu_ps(scores + size_t(j) * n8 + t0, sum_rows8(a));
    }
  }
  for (int j = 0; j < g; ++j) {  // softmax weights (unnormalized), 8 at a time
    float* s = scores + size_t(j) * n8;
    if (p.soft_cap > 0.f) {
      for (int t = 0; t < n; ++t) s[t] = p.soft_cap * std::tanh(s[t] / p.soft_cap);
    }
    for (int t = n; t < n8; ++t) s[t] = -INFINITY;  // the last chunk's discarded lanes
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int t = 0; t < n8; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
    const float top = with_sink(p, h * g + j, reduce_max8(mx));
    const __m256 max_s = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int t = 0; t < n8; t += 8) {
      const __m256 w = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), max_s));  // 0 past n
      _mm256_storeu_ps(s + t, w);
      sum = _mm256_add_ps(sum, w);
    }
    sums[j] = reduce_add8(sum) + sink_weight(p, h * g + j, top);
  }
  for (int j = 0; j < g; ++j) {  // values, weighted, one query head at a time
    const float* w = scores + size_t(j) * n8;
    __m256 acc[DV];
    PAGELLM_UNROLL for (int e = 0; e < DV; ++e) acc[e] = _mm256_setzero_ps();
    for (int t = 0; t < n; ++t) {
      const char* v = p.v_cache + offs[t];
      const __m256 wt = _mm256_set1_ps(w[t]);
      PAGELLM_UNROLL for (int e = 0; e < DV; ++e) {
        acc[e] = _mm256_fmadd_ps(wt, load8(v + e * v_bytes, CK, p.fp8_table), acc[e]);
      }
    }
    const __m256 norm = _mm256_set1_ps(p.v_scale / sums[j]);
    const int64_t off = row * p.o_stride_t + int64_t(h * g + j) * p.o_stride_h;
    PAGELLM_UNROLL for (int e = 0; e < DV; ++e) {
      const __m256 o = _mm256_mul_ps(acc[e], norm);
      if (p.q_kind == F32) {
        _mm256_storeu_ps(reinterpret_cast<float*>(p.out) + off + e * 8, o);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, o);
        uint16_t* dst = reinterpret_cast<uint16_t*>(p.out) + off + e * 8;
        for (int x = 0; x < 8; ++x) dst[x] = to_bf16(tmp[x]);
      }
    }
  }
}
#endif

void attend(const Problem& p, int64_t i, int h, std::vector<float>& buf) {
#if defined(__AVX512F__)
  // the usual head sizes; others take the scalar loop
  const int dv = p.head_dim % 16 == 0 ? p.head_dim / 16 : 0;
  auto by_kind = [&]<int DV>() {
    if (p.c_kind == F32) return attend_avx512<DV, F32>(p, i, h, buf);
    if (p.c_kind == BF16) return attend_avx512<DV, BF16>(p, i, h, buf);
    return attend_avx512<DV, FP8>(p, i, h, buf);
  };
  if (dv == 4) return by_kind.template operator()<4>();
  if (dv == 8) return by_kind.template operator()<8>();
  if (dv == 16) return by_kind.template operator()<16>();
#elif defined(PAGELLM_AVX2_ATTENTION)
  const int dv = p.head_dim % 8 == 0 ? p.head_dim / 8 : 0;
  auto by_kind = [&]<int DV>() {
    if (p.c_kind == F32) return attend_avx2<DV, F32>(p, i, h, buf);
    if (p.c_kind == BF16) return attend_avx2<DV, BF16>(p, i, h, buf);
    return attend_avx2<DV, FP8>(p, i, h, buf);
  };
  if (dv == 4) return by_kind.template operator()<4>();
  if (dv == 8) return by_kind.template operator()<8>();
  if (dv == 16) return by_kind.template operator()<16>();
  if (dv == 32) return by_kind.template operator()<32>();
#endif
  attend_scalar(p, i, h, buf);
}

}  // namespace

extern "C" void pagellm_paged_decode(
    void* out, const void* q, const void* k_cache, const void* v_cache,
    const int32_t* block_table, const int64_t* rows, const int64_t* reqs,
    const int32_t* lens, int64_t num_rows,
    const int64_t* strides,  // q: token, head; out: token, head; cache: block, slot, head; table
    const int32_t* dims,  // num_heads, num_kv_heads, head_dim, block_size, window, q/c kinds
    const float* fp8_table, float scale, float v_scale, float soft_cap,
    const float* sinks) {  // [num_heads] or null
  Problem p{static_cast<const char*>(q), static_cast<char*>(out),
            static_cast<const char*>(k_cache), static_cast<const char*>(v_cache),
            block_table, rows, reqs, lens, fp8_table,
            strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6],
            strides[7],
            dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
            scale, v_scale, soft_cap, sinks};
  const int64_t items = num_rows * p.num_kv_heads;  // (row, KV head), longest first
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t k; (k = next.fetch_add(1)) < items;) {
      attend(p, k / p.num_kv_heads, int(k % p.num_kv_heads), buf);
    }
  });
}
