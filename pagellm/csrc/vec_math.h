// Vector math shared by the CPU kernels of pagellm/csrc (AVX-512; exp on AVX2 + FMA too).
#pragma once

namespace pagellm {

// e^r for |r| <= ln2 / 2 by its Taylor series to r^7, Horner's order: 1/5040 first, then these
constexpr float kExpSeries[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

}  // namespace pagellm

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagellm {

// e^x within ~2 ulp of std::exp: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to
// r^7, times 2^n; 0 below -103 (as exp underflows), inf above 89
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, split
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : kExpSeries) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
}

}  // namespace pagellm
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace pagellm {

// exp_ps on 8 lanes (AVX2 + FMA): the same series; 2^n built in the exponent field, so
// x below -87.3 (where 2^n would be subnormal) gives 0 instead of e^x's tiny value
inline __m256 exp_ps(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2, split
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (float c : kExpSeries) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

}  // namespace pagellm
#endif
