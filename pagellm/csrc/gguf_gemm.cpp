// y = x @ W^T on the CPU with W kept as GGUF's 4- and 8-bit blocks: a few rows of float32
// (or bfloat16) activations against weights that are never dequantized to memory.
//
// W is the file's Q4_0 / Q4_1 / Q8_0 blocks of 32 weights, split at load into planes
// (pagellm/quantization/gguf_kernel.py, exactly: no value changes):
//   kind Q4:  qs [N, K / 2] uint8   block b of row n is bytes 16 b .. 16 b + 15; byte i holds
//                                   weight i (low nibble) and weight i + 16 (high nibble)
//             d, m [N, K / 32] fp16  w = d * q + m  (Q4_1 as stored; Q4_0: m = -8 d, exact)
//   kind Q4F: Q4 with m [N, K / 32] float32 (GPTQ / AWQ groups: m = -zero * scale, which
//             fp16 would round; pagellm/quantization/wna16_cpu.py)
//   kind Q8:  qs [N, K] int8, d [N, K / 32] fp16   w = d * q  (Q8_0)
//   int4 / int8 checkpoints' planes (Q4F, Q8) may hold one d (and m) a group of gb blocks
//   (the kind's bits above 8): d, m [N, ceil(K / 32 / gb)], the last group possibly shorter.
//   x [M, K] float32 or bfloat16 (row-major), 1 <= M <= 8; y [M, N] in x's dtype;
//   bias [N] float32 or null
//
// Per block, the stored integers are dotted with x, the dot is scaled by d, and m times the
// block's sum of x is added (one dot over the blocks at the end), accumulating in float32.
// Every product is exact: float32 FMAs, or for bfloat16 x against Q4 blocks on CPUs with
// AVX512-BF16, `vdpbf16ps` (the integers 0..15 are exact in bf16; 32 products an
// instruction). So the result is the dequantized weight's dot product up to float32
// rounding order, as another BLAS would give; no activation is rounded (llama.cpp's own
// kernels round x to int8 blocks: opt-in here, `QuantizedX`). Each block is unpacked once for every row of x; two
// accumulators per row of x alternate between blocks, so no add waits on the one before.
//
// Without AVX-512 the same runs on AVX2 + FMA vectors of 8 floats (laptop CPUs: Intel's
// since Alder Lake, AMD's before Zen 4). Rows of W are split over ATen's thread pool (torch's OpenMP threads). A plain C entry
// point for ctypes; gguf_kernel.py checks shapes and dtypes.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

enum Kind { Q4 = 0, Q8 = 1 };
constexpr int kBlock = 32;
constexpr int kMaxRows = 8;

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while (!(mant & 0x400)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x40);  // nan
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

struct Weights {
  const uint8_t* qs;
  const uint16_t* d;  // [N, groups]
  const uint16_t* m;  // Q4 only; [N, groups]
  int64_t N, K;
  const float* mf;  // Q4F: m in float32 (then m is null)
  int64_t gb = 1;  // blocks that share one d (and m): a GPTQ / AWQ group of 32 gb inputs
  // d / m entries a row: the last group may hold fewer blocks (K = 576 in groups of 128)
  int64_t groups() const { return (K / kBlock + gb - 1) / gb; }
};

// row n's scales one a block (a group's repeated over its blocks), float32
struct RowScales {
  std::vector<float> block, group;
  explicit RowScales(const Weights& w) : block(w.K / kBlock), group(w.groups()) {}
  const float* of(const Weights& w, int64_t n);
};

#if defined(__AVX512F__)
// block b's 32 stored integers of row `qs` as two float vectors (weights 0..15, 16..31)
template <int KIND>
inline void unpack(const uint8_t* qs, int64_t b, __m512* lo, __m512* hi) {
  if (KIND == Q8) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * 32));
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  } else {
    // the 16 code bytes widened once; a byte's low nibble is weight i, its high i + 16
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16)));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
}
#endif

#define PAGELLM_UNROLL _Pragma("GCC unroll 16")  // constant indices: registers, not the stack

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PAGELLM_AVX2_BLOCKS 1

// block b's 32 stored integers of row `qs` as four float vectors (weights 0..7, .., 24..31)
template <int KIND>
inline void unpack8(const uint8_t* qs, int64_t b, __m256* v) {
  __m128i first, second;  // 16 integers each: weights 0..15 and 16..31, one per byte
  if (KIND == Q8) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * 32));
    first = _mm256_castsi256_si128(q);
    second = _mm256_extracti128_si256(q, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8)));
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    first = _mm_and_si128(q, mask);
    second = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
  }
}

inline float reduce_add8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// sum of a[i] * b[i], a vector at a time (partial sums, then theirs): for the offsets' share of
// one output (m[b] * xsum[b] over blocks; the serial sum's chain of dependent adds cost more
// than the block loop itself at K = 576) and the greedy head's exact rows
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  }
  s = _mm512_reduce_add_ps(acc);
#elif defined(PAGELLM_AVX2_BLOCKS)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  s = reduce_add8(acc);
#endif
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

inline float offset_dot(const uint16_t* m, const float* xsum, int64_t blocks) {
  float s = 0.0f;
  int64_t b = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; b + 16 <= blocks; b += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + b));
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(h), _mm512_loadu_ps(xsum + b), acc);
  }
  s = _mm512_reduce_add_ps(acc);
#elif defined(PAGELLM_AVX2_BLOCKS)
  __m256 acc = _mm256_setzero_ps();
  for (; b + 8 <= blocks; b += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b));
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(xsum + b), acc);
  }
  s = reduce_add8(acc);
#endif
  for (; b < blocks; ++b) s = std::fma(half_to_float(m[b]), xsum[b], s);  // fused, always
  return s;
}

// the fp16 block scales of one row as float32, a vector at a time
inline void halves_to_floats(const uint16_t* d, int64_t blocks, float* out) {
  int64_t b = 0;
#if defined(__AVX512F__)
  for (; b + 16 <= blocks; b += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b));
    _mm512_storeu_ps(out + b, _mm512_cvtph_ps(h));
  }
#elif defined(PAGELLM_AVX2_BLOCKS)
  for (; b + 8 <= blocks; b += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b));
    _mm256_storeu_ps(out + b, _mm256_cvtph_ps(h));
  }
#endif
  for (; b < blocks; ++b) out[b] = half_to_float(d[b]);
}

const float* RowScales::of(const Weights& w, int64_t n) {
  const int64_t groups = w.groups();
  if (w.gb == 1) {
    halves_to_floats(w.d + n * groups, groups, block.data());
    return block.data();
  }
  halves_to_floats(w.d + n * groups, groups, group.data());
  float* out = block.data();  // no division a block: a few stores a group
  float* const end = out + block.size();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t j = 0; j < w.gb && out < end; ++j) *out++ = group[g];
  }
  return block.data();
}

// blocks 0 .. blocks - 1 through `block(b, acc)`, even ones into `even`, odd ones into
// `odd`, taken in pairs so that every accumulator index is a constant: GCC then keeps the
// accumulators in registers (indexed acc[r][b & 1] it kept them on the stack, each FMA
// waiting on a store)
template <typename Vec, typename Block>
inline void blocks_in_pairs(int64_t blocks, Vec* even, Vec* odd, Block&& block) {
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    block(b, even);
    block(b + 1, odd);
  }
  if (b < blocks) block(b, even);
}

// y[r, n] from the row's scaled block dots: plus the offsets' share (Q4) and the bias
inline void store_output(float dots, const Weights& w, const float* xsum, int r, int64_t n,
                         bool offsets, float* y, const float* bias) {
  const int64_t groups = w.groups();  // xsum: [MR, groups], x summed over each group
  if (offsets && w.mf) {
    dots += dot_f32(w.mf + n * groups, xsum + r * groups, groups);
  } else if (offsets) {
    dots += offset_dot(w.m + n * groups, xsum + r * groups, groups);
  }
  y[r * w.N + n] = dots + (bias ? bias[n] : 0.0f);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGELLM_BF16_DOTS 1
// bf16 x [M, K] re-laid for `q4_rows_bf16`: blocks b, b + 1 (b even) as x_b[0..15],
// x_b+1[0..15], x_b[16..31], x_b+1[16..31] (the order in which the pair's 32 code bytes
// unpack: low nibbles, then high); an odd last block as it is
void pair_x(const uint16_t* x, int64_t M, int64_t K, std::vector<uint16_t>* out) {
  const int64_t pairs = K / kBlock / 2;
  out->resize(M * K);
  for (int64_t r = 0; r < M; ++r) {
    const uint16_t* xr = x + r * K;
    uint16_t* o = out->data() + r * K;
    for (int64_t p = 0; p < pairs; ++p) {
      for (int half = 0; half < 2; ++half) {  // weights 0..15, then 16..31 of both blocks
        std::memcpy(o + p * 64 + half * 32, xr + p * 64 + half * 16, 32);
        std::memcpy(o + p * 64 + half * 32 + 16, xr + p * 64 + kBlock + half * 16, 32);
      }
    }
    std::memcpy(o + pairs * 64, xr + pairs * 64, (K - pairs * 64) * 2);
  }
}

// Q4 rows n0 .. n1 for bf16 x (xp: [MR, K] re-laid by `pair_x`) with the dot products on
// bf16 pairs: the stored 0..15 are exact in bf16 (a 16-entry table), so `vdpbf16ps` forms
// the exact products and sums them in float32. A pair of blocks a step: their 32 code bytes
// widened to 16-bit lanes once, the low and the high nibbles each looked up in the table
// (lanes 0-15 block b's, 16-31 block b + 1's), two `vdpbf16ps` a row of x, and lanes 0-7 /
// 8-15 of the sums scaled by d_b / d_b+1; an odd last block alone. (Per pair: 4 shuffles
// where a block at a time took 6.)
template <int MR>
void q4_rows_bf16(const Weights& w, const uint16_t* xp, const float* xsum, int64_t n0,
                  int64_t n1, float* y, const float* bias) {
  const int64_t K = w.K, blocks = K / kBlock, pairs = blocks / 2;
  alignas(64) uint16_t table_values[32];
  for (int v = 0; v < 16; ++v) {
    const float f = float(v);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    table_values[v] = table_values[v + 16] = uint16_t(bits >> 16);  // exact: v has <= 4 bits
  }
  const __m512i table = _mm512_load_si512(table_values);
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  RowScales scales(w);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qs = w.qs + n * (K / 2);
    const float* scale = scales.of(w, n);
    __m512 even[MR], odd[MR];  // `blocks_in_pairs`, over pairs of blocks
    PAGELLM_UNROLL for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    auto pair = [&](int64_t p, __m512* acc) __attribute__((always_inline)) {
      const __m512i bytes = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + p * 32)));
      const auto lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, low4), table);
      const auto hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
      double two;  // scale[2p], scale[2p + 1]
      std::memcpy(&two, scale + 2 * p, 8);
      const __m512 ws = _mm512_permutexvar_ps(pick, _mm512_castpd_ps(_mm512_set1_pd(two)));
      PAGELLM_UNROLL for (int r = 0; r < MR; ++r) {
        const uint16_t* xr = xp + r * K + p * 64;
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xr));
        dot = _mm512_dpbf16_ps(dot, hi, (__m512bh)_mm512_loadu_si512(xr + 32));
        acc[r] = _mm512_fmadd_ps(dot, ws, acc[r]);
      }
    };
    blocks_in_pairs(pairs, even, odd, pair);
    if (blocks & 1) {  // the odd last block: its 32 weights in one vector
      const int64_t b = blocks - 1;
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
      const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask),
                                               _mm_and_si128(q, mask));  // weights 0..31
      const auto wb = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nibbles), table);
      const __m512 vscale = _mm512_set1_ps(scale[b]);
      PAGELLM_UNROLL for (int r = 0; r < MR; ++r) {
        const auto xb = (__m512bh)_mm512_loadu_si512(xp + r * K + b * kBlock);
        even[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), wb, xb), vscale, even[r]);
      }
    }
    for (int r = 0; r < MR; ++r)
      store_output(_mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])), w, xsum, r, n, true, y,
                   bias);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define PAGELLM_INT8_DOTS 1

// x rounded to int8 blocks, llama.cpp's Q8_0 numerics (opt-in: kind bit 4): per row and block
// of 32, d = max |x| / 127 and q = x * (127 / max |x|) rounded to nearest even, so x ~ d q.
// The Q4 blocks are then dotted with q in integers (`vpdpbusd`: 64 byte products an
// instruction), and each block's integer dot times d_w d_x is summed in float32. Blocks b,
// b + 1 (b even) are stored for the pair loop as x_b[0..15], x_b+1[0..15], x_b[16..31],
// x_b+1[16..31]: the order in which the pair's 32 weight bytes unpack (low nibbles, then
// high); an odd last block in its own order.
struct QuantizedX {
  std::vector<int8_t> q;  // [M, K], pairs interleaved as above
  std::vector<float> d;  // [M, K / 32]
  std::vector<float> sum;  // [M, groups]: d * sum(q) over each group, the offsets' factor
  std::vector<float> pair_d;  // [M, K / 64, 16]: d_b four times, d_b+1 four times, twice
};

void quantize_x(const float* xf, int64_t M, int64_t K, int64_t gb, QuantizedX* out) {
  const int64_t blocks = K / kBlock, pairs = blocks / 2;
  out->q.resize(M * K);
  out->d.resize(M * blocks);
  const int64_t groups = (blocks + gb - 1) / gb;
  out->sum.assign(M * groups, 0.0f);
  out->pair_d.resize(M * pairs * 16);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xf + r * K + b * kBlock;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
      int8_t* at = out->q.data() + r * K + b * kBlock;  // an odd last block: as is
      int64_t second = 16;
      if (b < 2 * pairs) {
        at = out->q.data() + r * K + (b & ~int64_t(1)) * kBlock + (b & 1) * 16;
        second = 32;
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at + second), _mm512_cvtsepi32_epi8(q1));
      out->d[r * blocks + b] = d;
      const int32_t qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      out->sum[r * groups + b / gb] += d * float(qsum);
    }
    for (int64_t p = 0; p < pairs; ++p) {
      float* pd = out->pair_d.data() + (r * pairs + p) * 16;
      for (int i = 0; i < 16; ++i) pd[i] = out->d[r * blocks + 2 * p + ((i >> 2) & 1)];
    }
  }
}

// Q4 rows n0 .. n1 against x rounded to int8 blocks (xq; MR rows), a pair of blocks a step:
// 32 bytes of nibbles become 64 weight bytes 0..15 (low nibbles of both blocks, then high),
// one `vpdpbusd` per row of x sums them in fours, lanes 0-3 and 8-11 block b's, 4-7 and
// 12-15 block b + 1's, each scaled by its d_w d_x in float32.
template <int MR>
void q4_rows_int8(const Weights& w, const QuantizedX& xq, int64_t n0, int64_t n1, float* y,
                  const float* bias) {
  const int64_t K = w.K, blocks = K / kBlock, pairs = blocks / 2;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  RowScales scales(w);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qs = w.qs + n * (K / 2);
    const float* scale = scales.of(w, n);
    __m512 even[MR], odd[MR];  // `blocks_in_pairs`, over pairs of blocks
    PAGELLM_UNROLL for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    auto pair = [&](int64_t p, __m512* acc) __attribute__((always_inline)) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + p * 32));
      const __m512i wq = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_and_si256(q, mask)),
          _mm256_and_si256(_mm256_srli_epi16(q, 4), mask), 1);
      double two;  // scale[2p], scale[2p + 1]
      std::memcpy(&two, scale + 2 * p, 8);
      const __m512 ws = _mm512_permutexvar_ps(pick, _mm512_castpd_ps(_mm512_set1_pd(two)));
      PAGELLM_UNROLL for (int r = 0; r < MR; ++r) {
        const __m512i xv = _mm512_loadu_si512(xq.q.data() + r * K + p * 64);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xv);
        const __m512 xs = _mm512_loadu_ps(xq.pair_d.data() + (r * pairs + p) * 16);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xs), acc[r]);
      }
    };
    blocks_in_pairs(pairs, even, odd, pair);
    float tail[MR] = {};
    if (blocks & 1) {  // the odd last block: 32 weights, 256 bits
      const int64_t b = blocks - 1;
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
      const __m128i m4 = _mm_set1_epi8(0x0F);
      const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4),
                                          _mm_and_si128(q, m4));
      for (int r = 0; r < MR; ++r) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * K + b * 32));
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xv);
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(dot));  // exact
        tail[r] = float(sum) * (scale[b] * xq.d[r * blocks + b]);
      }
    }
    for (int r = 0; r < MR; ++r)
      store_output(_mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + tail[r], w,
                   xq.sum.data(), r, n, true, y, bias);
  }
}
#endif

// rows n0 .. n1 of y for MR rows of x (xf: float32 [MR, K]; xsum: [MR, K / 32] block sums)
template <int KIND, int MR>
void rows_of_y(const Weights& w, const float* xf, const float* xsum, int64_t n0, int64_t n1,
               float* y, const float* bias) {
  const int64_t K = w.K, blocks = K / kBlock;
  const int64_t row_bytes = KIND == Q8 ? K : K / 2;
  RowScales scales(w);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qs = w.qs + n * row_bytes;
    const float* scale = scales.of(w, n);
#if defined(__AVX512F__)
    __m512 even[MR], odd[MR];  // `blocks_in_pairs`
    PAGELLM_UNROLL for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    auto block = [&](int64_t b, __m512* acc) __attribute__((always_inline)) {
      __m512 lo, hi;
      unpack<KIND>(qs, b, &lo, &hi);
      const __m512 vscale = _mm512_set1_ps(scale[b]);
      PAGELLM_UNROLL for (int r = 0; r < MR; ++r) {
        const float* xb = xf + r * K + b * kBlock;
        __m512 dot = _mm512_mul_ps(lo, _mm512_loadu_ps(xb));
        dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), dot);
        acc[r] = _mm512_fmadd_ps(dot, vscale, acc[r]);
      }
    };
    blocks_in_pairs(blocks, even, odd, block);
    for (int r = 0; r < MR; ++r)
      store_output(_mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])), w, xsum, r, n,
                   KIND == Q4, y, bias);
#elif defined(PAGELLM_AVX2_BLOCKS)  // the same with 8-float vectors (no AVX-512)
    __m256 even[MR], odd[MR];
    PAGELLM_UNROLL for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    auto block = [&](int64_t b, __m256* acc) __attribute__((always_inline)) {
      __m256 v[4];
      unpack8<KIND>(qs, b, v);
      const __m256 vscale = _mm256_set1_ps(scale[b]);
      PAGELLM_UNROLL for (int r = 0; r < MR; ++r) {
        const float* xb = xf + r * K + b * kBlock;
        __m256 dot = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
        dot = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), dot);
        dot = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), dot);
        dot = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), dot);
        acc[r] = _mm256_fmadd_ps(dot, vscale, acc[r]);
      }
    };
    blocks_in_pairs(blocks, even, odd, block);
    for (int r = 0; r < MR; ++r)
      store_output(reduce_add8(_mm256_add_ps(even[r], odd[r])), w, xsum, r, n, KIND == Q4, y,
                   bias);
#else
    for (int r = 0; r < MR; ++r) {
      const float* xr = xf + r * K;
      float out = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        float dot = 0.0f;
        for (int i = 0; i < kBlock; ++i) {
          float q;
          if (KIND == Q8) {
            q = float(reinterpret_cast<const int8_t*>(qs)[b * 32 + i]);
          } else {
            const uint8_t byte = qs[b * 16 + (i & 15)];
            q = float(i < 16 ? byte & 0x0F : byte >> 4);
          }
          dot += q * xr[b * kBlock + i];
        }
        out += dot * scale[b];
      }
      store_output(out, w, xsum, r, n, KIND == Q4, y, bias);
    }
#endif
  }
}

struct Activations {  // x in the forms the kernels read
  const float* xf;  // [M, K] float32
  const float* xsum;  // [M, groups]: x summed over each group of blocks (the offsets' factor)
  const uint16_t* xh;  // Q4: bf16 x re-laid by `pair_x`, or null (float32 x)
  const void* xq;  // x rounded to int8 blocks (a QuantizedX), or null (exact products)
};

template <int KIND, int MR>
void gemm(const Weights& w, const Activations& a, float* y, const float* bias) {
  // grain: 16 rows of W (a few KB) per task
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
#if defined(PAGELLM_INT8_DOTS)
    if (KIND == Q4 && a.xq) {
      return q4_rows_int8<MR>(w, *static_cast<const QuantizedX*>(a.xq), n0, n1, y, bias);
    }
#endif
#if defined(PAGELLM_BF16_DOTS)
    if (KIND == Q4 && a.xh) return q4_rows_bf16<MR>(w, a.xh, a.xsum, n0, n1, y, bias);
#endif
    rows_of_y<KIND, MR>(w, a.xf, a.xsum, n0, n1, y, bias);
  });
}

template <int KIND>
void dispatch_rows(int64_t M, const Weights& w, const Activations& a, float* y,
                   const float* bias) {
  switch (M) {
    case 1: gemm<KIND, 1>(w, a, y, bias); break;
    case 2: gemm<KIND, 2>(w, a, y, bias); break;
    case 3: gemm<KIND, 3>(w, a, y, bias); break;
    case 4: gemm<KIND, 4>(w, a, y, bias); break;
    case 5: gemm<KIND, 5>(w, a, y, bias); break;
    case 6: gemm<KIND, 6>(w, a, y, bias); break;
    case 7: gemm<KIND, 7>(w, a, y, bias); break;
    default: gemm<KIND, 8>(w, a, y, bias); break;
  }
}

}  // namespace

// kind: 0 Q4 (qs, d, m), 1 Q8 (qs, d; m null), 2 Q4F (qs, d, m as float32); plus 4 (Q4 and
// Q4F): x rounded to int8 blocks (`QuantizedX`; where the CPU has no AVX512-VNNI, ignored:
// exact products); plus gb << 8 where gb > 1 blocks share one d / m (d, m: [N, ceil(K / 32 /
// gb)], the last group possibly shorter; else [N, K / 32]). x_bf16: x and y are bfloat16, else
// float32.
// Returns 0, or -1 for arguments the kernel does not take.
extern "C" int pagellm_gguf_gemm(const void* x, int64_t M, int64_t K, int x_bf16, int kind,
                                 const uint8_t* qs, const uint16_t* d, const void* m,
                                 int64_t N, void* y, const float* bias) {
  constexpr int kQ4F = 2, kInt8X = 4;
  const int64_t gb = kind >> 8 ? kind >> 8 : 1;
  const bool int8_x = kind & kInt8X;
  kind &= 0xFF & ~kInt8X;
  if (M < 1 || M > kMaxRows || K % kBlock || gb > (1 << 20)) return -1;
  if (kind < Q4 || kind > kQ4F) return -1;
  if (int8_x && kind == Q8) return -1;
  if (kind != Q8 && m == nullptr) return -1;
  const float* mf = kind == kQ4F ? static_cast<const float*>(m) : nullptr;
  const uint16_t* m16 = kind == Q4 ? static_cast<const uint16_t*>(m) : nullptr;
  if (kind == kQ4F) kind = Q4;
  const Weights w{qs, d, m16, N, K, mf, gb};
  const int64_t groups = w.groups(), group_len = gb * kBlock;
  std::vector<float> xf(M * K), xsum(M * groups), yf;
  for (int64_t i = 0; i < M * K; ++i) {
    xf[i] = x_bf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i])
                   : static_cast<const float*>(x)[i];
  }
  for (int64_t r = 0; r < M; ++r) {  // x summed over each group, for the offsets
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * group_len; k < std::min(K, (g + 1) * group_len); ++k) {
        s += xf[r * K + k];
      }
      xsum[r * groups + g] = s;
    }
  }
  float* yout = static_cast<float*>(y);
  if (x_bf16) {
    yf.resize(M * N);
    yout = yf.data();
  }
  Activations a{xf.data(), xsum.data(), nullptr, nullptr};
#if defined(PAGELLM_BF16_DOTS)
  std::vector<uint16_t> xp;
  if (x_bf16 && kind == Q4 && !int8_x) {
    pair_x(static_cast<const uint16_t*>(x), M, K, &xp);
    a.xh = xp.data();
  }
#endif
#if defined(PAGELLM_INT8_DOTS)
  QuantizedX xq;
  if (int8_x) {
    quantize_x(xf.data(), M, K, gb, &xq);
    a.xq = &xq;
  }
#endif
  if (kind == Q4) {
    dispatch_rows<Q4>(M, w, a, yout, bias);
  } else {
    dispatch_rows<Q8>(M, w, a, yout, bias);
  }
  if (x_bf16) {
    uint16_t* yb = static_cast<uint16_t*>(y);
    for (int64_t i = 0; i < M * N; ++i) yb[i] = float_to_bf16(yf[i]);
  }
  return 0;
}

namespace {

// rows [n0, n1) of W dequantized into `out` ([N, K], float32 or bfloat16): w = d * q + m
// (Q8: d * q), the values the dequantized copy holds (each d * q is exact in float32, so
// one rounding at most, whichever way the compiler fuses it)
#if defined(__AVX512F__)
// 16 floats rounded to bfloat16 (nearest even; finite values) and stored
inline void store_bf16(uint16_t* o, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
}
#endif

#if defined(PAGELLM_AVX2_BLOCKS)
// 8 floats rounded to bfloat16 (nearest even; finite values) and stored
inline void store_bf16_8(uint16_t* o, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(up), _mm256_extracti128_si256(up, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), packed);
}
#endif

template <int KIND, bool BF16>
void dequant_rows(const Weights& w, int64_t n0, int64_t n1, void* out) {
  const int64_t blocks = w.K / kBlock;
  for (int64_t at = n0 * blocks; at < n1 * blocks; ++at) {  // the planes' blocks, row-major
    const int64_t g = at / blocks * w.groups() + at % blocks / w.gb;  // its group's d and m
    const float d = half_to_float(w.d[g]);
    const float m = KIND == Q8 ? 0.0f : w.mf ? w.mf[g] : half_to_float(w.m[g]);
#if defined(__AVX512F__)  // two vectors of 16, as the GEMM unpacks a block
    __m512 v[2];
    unpack<KIND>(w.qs, at, &v[0], &v[1]);
    for (int j = 0; j < 2; ++j) {  // d * q is exact: the fused multiply-add rounds once
      v[j] = KIND == Q8 ? _mm512_mul_ps(v[j], _mm512_set1_ps(d))
                        : _mm512_fmadd_ps(v[j], _mm512_set1_ps(d), _mm512_set1_ps(m));
      if (BF16) {
        store_bf16(static_cast<uint16_t*>(out) + at * kBlock + 16 * j, v[j]);
      } else {
        _mm512_storeu_ps(static_cast<float*>(out) + at * kBlock + 16 * j, v[j]);
      }
    }
#elif defined(PAGELLM_AVX2_BLOCKS)  // the same in four vectors of 8
    __m256 v[4];
    unpack8<KIND>(w.qs, at, v);
    for (int j = 0; j < 4; ++j) {
      v[j] = KIND == Q8 ? _mm256_mul_ps(v[j], _mm256_set1_ps(d))
                        : _mm256_fmadd_ps(v[j], _mm256_set1_ps(d), _mm256_set1_ps(m));
      if (BF16) {
        store_bf16_8(static_cast<uint16_t*>(out) + at * kBlock + 8 * j, v[j]);
      } else {
        _mm256_storeu_ps(static_cast<float*>(out) + at * kBlock + 8 * j, v[j]);
      }
    }
#else
    float vals[kBlock];
    if (KIND == Q8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + at * kBlock;
      for (int i = 0; i < kBlock; ++i) vals[i] = d * float(q[i]);
    } else {
      const uint8_t* q = w.qs + at * (kBlock / 2);
      for (int i = 0; i < kBlock / 2; ++i) {
        vals[i] = d * float(q[i] & 0x0F) + m;
        vals[i + kBlock / 2] = d * float(q[i] >> 4) + m;
      }
    }
    if (BF16) {  // round to nearest even; the values are finite
      uint16_t* o = static_cast<uint16_t*>(out) + at * kBlock;
      for (int i = 0; i < kBlock; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &vals[i], 4);
        o[i] = uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
      }
    } else {
      std::memcpy(static_cast<float*>(out) + at * kBlock, vals, sizeof(vals));
    }
#endif
  }
}

template <int KIND>
void dequant_all(const Weights& w, void* out, bool bf16) {
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
    if (bf16) {
      dequant_rows<KIND, true>(w, n0, n1, out);
    } else {
      dequant_rows<KIND, false>(w, n0, n1, out);
    }
  });
}

}  // namespace

// The planes of `pagellm_gguf_gemm` (kind as there, the int8 bit ignored) dequantized into
// out [N, K]: bfloat16 where out_bf16, else float32. For batches too large for the blocks when
// no dequantized copy is kept (gguf_kernel.dequantize_into_scratch). Returns 0, or -1.
extern "C" int pagellm_gguf_dequant(int kind, const uint8_t* qs, const uint16_t* d,
                                    const void* m, int64_t N, int64_t K, void* out,
                                    int out_bf16) {
  constexpr int kQ4F = 2, kInt8X = 4;
  const int64_t gb = kind >> 8 ? kind >> 8 : 1;
  kind &= 0xFF & ~kInt8X;
  if (N < 1 || K < kBlock || K % kBlock || gb > (1 << 20)) return -1;
  if (kind < Q4 || kind > kQ4F || (kind != Q8 && m == nullptr)) return -1;
  const Weights w{qs, d, kind == Q4 ? static_cast<const uint16_t*>(m) : nullptr, N, K,
                  kind == kQ4F ? static_cast<const float*>(m) : nullptr, gb};
  if (kind == Q8) {
    dequant_all<Q8>(w, out, out_bf16);
  } else {
    dequant_all<Q4>(w, out, out_bf16);
  }
  return 0;
}

namespace {

// one row of x's pick over a range of the vocabulary: the highest lower bound seen, and the
// rows whose upper bound reached the floor as it stood then (pruned as it rises)
struct Pick {
  float floor = -INFINITY;
  bool finite = true;
  bool too_many = false;  // more rows could win than the caller takes: keeping stopped
  std::vector<std::pair<int64_t, float>> keep;  // (row of W, its upper bound)

  void prune() {
    std::erase_if(keep, [&](const auto& c) { return c.second < floor; });
  }
};

// the Q8 pass over rows of W in chunks, each chunk's approximate logits bounded while in cache
template <int MR>
void greedy_pass(const Weights& w, const float* xf, const float* xsum, const float* l1,
                 const float* bound, int64_t max_keep, float* a, std::vector<Pick>& picks) {
  constexpr int64_t kChunk = 64;
  at::parallel_for(0, w.N, kChunk, [&](int64_t n0, int64_t n1) {
    Pick* mine = picks.data() + at::get_thread_num() * MR;
    for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
      const int64_t c1 = c0 + kChunk < n1 ? c0 + kChunk : n1;
      rows_of_y<Q8, MR>(w, xf, xsum, c0, c1, a, nullptr);
      for (int r = 0; r < MR; ++r) {
        Pick& p = mine[r];
        for (int64_t n = c0; n < c1; ++n) {
          const float lo = a[r * w.N + n] - l1[r] * bound[n];
          const float hi = a[r * w.N + n] + l1[r] * bound[n];
          p.finite = p.finite && std::isfinite(lo) && std::isfinite(hi);
          p.floor = lo > p.floor ? lo : p.floor;
          if (hi >= p.floor && !p.too_many) p.keep.emplace_back(n, hi);
        }
        if (p.keep.size() > 256) p.prune();
        p.too_many = p.too_many || int64_t(p.keep.size()) > max_keep;  // a flat head
      }
    }
  });
}

}  // namespace

// The greedy head's argmax (pagellm/sample/greedy_head.py) in one call: for each of M <= 3
// rows of float32 x, approximate logits a = x @ Q8^T (the kind-1 blocks above, into `scratch`
// [M, N]), each within |x|_1 * bound[n] of the float head's logit; the rows n with
// a[n] + |x|_1 bound[n] >= max_j (a[j] - |x|_1 bound[j]) can win, and their exact logits
// x . weight[n] (float32) decide, the lower id on a tie. The bounds are taken chunk by chunk
// as the pass writes a (no second pass over the vocabulary). Returns 0 (ids [M] written), 1
// where the head must be computed (a value or bound not finite, or more than max_candidates
// rows that can win), -1 for bad arguments.
extern "C" int pagellm_greedy_argmax(const float* x, int64_t M, int64_t K, const uint8_t* qs,
                                     const uint16_t* d, int64_t N, const float* bound,
                                     const float* weight, int64_t max_candidates,
                                     float* scratch, int64_t* ids) {
  if (M < 1 || M > 3 || K % kBlock || N < 1) return -1;
  const Weights w{qs, d, nullptr, N, K, nullptr};
  float l1[3];
  for (int64_t r = 0; r < M; ++r) {  // |x|_1 rounded up a little: rounding must not shrink it
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k) sum += std::fabs(double(x[r * K + k]));
    l1[r] = float(sum * (1.0 + 1e-6));
  }
  std::vector<Pick> picks(size_t(at::get_num_threads()) * M);
  if (M == 1) greedy_pass<1>(w, x, nullptr, l1, bound, max_candidates, scratch, picks);
  if (M == 2) greedy_pass<2>(w, x, nullptr, l1, bound, max_candidates, scratch, picks);
  if (M == 3) greedy_pass<3>(w, x, nullptr, l1, bound, max_candidates, scratch, picks);
  int64_t total = 0;
  for (int64_t r = 0; r < M; ++r) {
    Pick all;  // the threads' picks of row r together
    for (size_t t = r; t < picks.size(); t += M) {
      all.floor = picks[t].floor > all.floor ? picks[t].floor : all.floor;
      all.finite = all.finite && picks[t].finite && !picks[t].too_many;
      all.keep.insert(all.keep.end(), picks[t].keep.begin(), picks[t].keep.end());
    }
    all.prune();
    total += int64_t(all.keep.size());
    if (!all.finite || all.keep.empty() || total > max_candidates) return 1;
    std::sort(all.keep.begin(), all.keep.end());  // ascending ids: a tie keeps the lower
    const float* xr = x + r * K;
    int64_t best = all.keep[0].first;
    float best_logit = dot_f32(xr, weight + best * K, K);
    for (size_t i = 1; i < all.keep.size(); ++i) {
      const float logit = dot_f32(xr, weight + all.keep[i].first * K, K);
      if (logit > best_logit) {
        best = all.keep[i].first;
        best_logit = logit;
      }
    }
    ids[r] = best;
  }
  return 0;
}
