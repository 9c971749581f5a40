// Decode attention on the CPU that reads the paged KV cache in place.
//
// One query token per request (a decode) attends to its request's cached keys through the
// block table: no gathered copy of the keys and values is made. Work item = (request, KV
// head): the query heads sharing that KV head (GQA) are scored against each key row as it
// is read, then the values are mixed with the softmax weights.
//
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
//                           float32, bfloat16 or float8 (read through a 256-entry table)
//   q, out:                 [num_tokens, num_heads, head_dim] float32 or bfloat16
//   rows [n] int64:         the decodes' rows of q / out
//   reqs [n] int64:         their requests (rows of block_table, seq_lens)
//   block_table [R, max_blocks] int32, seq_lens [R] int32
//
// scale multiplies q.k (an fp8 cache: times k_scale), v_scale the output; window W > 0:
// only the last W keys are read; soft_cap c > 0: scores become c * tanh(score / c).
// Accumulation is float32 throughout. Items are taken longest first from a shared counter
// (the caller passes rows sorted by length), so threads finish together.
//
// A plain C entry point for ctypes (pagellm/attention/cpu_decode.py checks shapes, dtypes
// and strides): only ATen's thread pool is used from torch, so this compiles in about a
// second. Built with -fopenmp, its `at::parallel_for` runs on torch's OpenMP runtime (the
// libgomp torch has loaded) with torch's thread count.

#include <ATen/Parallel.h>

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
  const int32_t* seq_lens;
  const int64_t* rows;
  const int64_t* reqs;
  const float* fp8_table;  // FP8: the cache's 256 byte values as float
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;  // elements
  int64_t c_stride_b, c_stride_s, c_stride_h;  // elements of the cache
  int64_t bt_stride;
  int num_heads, num_kv_heads, head_dim, block_size, window;
  int q_kind, c_kind;
  float scale, v_scale, soft_cap;
};

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

// decode `i`'s query heads on KV head `h`; buf: the thread's scratch
void attend(const Problem& p, int64_t i, int h, std::vector<float>& buf) {
  const int d = p.head_dim;
  const int g = p.num_heads / p.num_kv_heads;  // query heads of this KV head
  const int64_t req = p.reqs[i], row = p.rows[i];
  const int len = p.seq_lens[req];
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
    for (int t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - max_s[j]);
      sum[j] += s[t];
    }
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

}  // namespace

extern "C" void pagellm_paged_decode(
    void* out, const void* q, const void* k_cache, const void* v_cache,
    const int32_t* block_table, const int32_t* seq_lens, const int64_t* rows,
    const int64_t* reqs, int64_t num_decodes,
    const int64_t* strides,  // q: token, head; out: token, head; cache: block, slot, head; table
    const int32_t* dims,  // num_heads, num_kv_heads, head_dim, block_size, window, q/c kinds
    const float* fp8_table, float scale, float v_scale, float soft_cap) {
  Problem p{static_cast<const char*>(q), static_cast<char*>(out),
            static_cast<const char*>(k_cache), static_cast<const char*>(v_cache),
            block_table, seq_lens, rows, reqs, fp8_table,
            strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6],
            strides[7],
            dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
            scale, v_scale, soft_cap};
  const int64_t items = num_decodes * p.num_kv_heads;  // (decode, KV head), longest first
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t k; (k = next.fetch_add(1)) < items;) {
      attend(p, k / p.num_kv_heads, int(k % p.num_kv_heads), buf);
    }
  });
}
