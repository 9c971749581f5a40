// A Llama-family decoder's layers for one step on the CPU, in one call: the same kernels the
// Python layers call one by one (pagellm/csrc/cpu_fused.cpp, panel_gemm.cpp,
// paged_decode.cpp), in the same order on the same buffers, so the results are bit for bit
// the layer-by-layer path's. What it saves is the ~10 Python-level calls a layer (module
// calls, argument checks, tensor allocations, ctypes): at a decode step of a small model
// on a 2-core machine they cost as much as the GEMMs (docs/notes.md).
//
// The kernels are reached through the function pointers the caller passes (their C entry
// points in their own libraries), so no kernel is compiled twice. Activations and the KV
// cache in bf16 or float32; each GEMM through GGUF blocks (gguf_gemm.cpp) for steps of up to
// the rows its layer reads them for, else through our panels (panel_gemm.cpp, either dtype):
// the rule of the Python layers (pagellm/quantization/gguf_cpu.py). Every query row goes
// through the in-place paged attention.
//
// Per layer, with T rows (h: hidden; res: the residual stream):
//   res, x = x + res, rms_norm(x + res)      (layer 0: res = x, x = rms_norm(x))
//   qkv = x @ Wqkv^T (+ b)                   [T, (H + 2 H_kv) D]
//   [Qwen3: q, k = per-head rms_norm]        in qkv
//   qk = rotary(q | k)                       [T, H + H_kv, D]
//   cache[slot[t]] = k, v                    this step's keys first, then
//   a = paged_attention(q, cache)            [T, H, D]
//   x = a @ Wo^T (+ b)
//   res, x = x + res, rms_norm(x + res)
//   x = down(silu(gate) * up)                [T, I] between
// and after the last layer x, res are the caller's (the final norm is the model's). With
// LoRA adapters (`s->lora`), each projection's output then gets its rows' adapter deltas
// from lora_cpu.cpp's entry point, the one the Python layers call after their GEMM.

#include <cstdint>
#include <cstring>
#include <vector>

#include "lora_cpu.h"

namespace {

constexpr int kBlockRows = 8;  // rows of x per call of the GGUF block kernel
constexpr int64_t kLoraParts = 3;  // a projection's adapter parts in the loop's array (q k v)

using RmsNormFn = void (*)(void*, void*, const void*, const void*, const void*, int64_t,
                           int64_t, int64_t, const int64_t*, float, int);
using RotaryFn = void (*)(void*, const void*, const void*, int64_t, int64_t, int64_t, int64_t,
                          const int64_t*, int);
using SiluMulFn = void (*)(void*, const void*, int64_t, int64_t, const int64_t*, int);
using GemmFn = int (*)(const void*, int64_t, int64_t, int64_t, const void*, int64_t,
                       const float*, void*, int64_t);  // bf16 or float32 panels
using BlockGemmFn = int (*)(const void*, int64_t, int64_t, int, int, const void*, const void*,
                            const void*, int64_t, void*, const float*);
using AttentionFn = void (*)(void*, const void*, const void*, const void*, const int32_t*,
                             const int64_t*, const int64_t*, const int32_t*, int64_t,
                             const int64_t*, const int32_t*, const float*, float, float, float,
                             const float*);

}  // namespace

extern "C" {

struct PagellmDecoderFns {
  RmsNormFn rms_norm;
  RotaryFn rotary;
  SiluMulFn silu_and_mul;
  GemmFn gemm;  // bf16 panels (null where not built)
  GemmFn gemm_f32;  // float32 panels
  BlockGemmFn block_gemm;  // GGUF blocks (null where not built)
  AttentionFn attention;
};

struct PagellmDecoderGemm {  // one projection's weight: panels, GGUF blocks, or both
  const void* panels;  // bf16 [ceil(N / 32), K / 2, 32, 2] / float32 [.., K, 32], or null
  const void* qs;  // GGUF planes (gguf_gemm.cpp), or null
  const void* d;
  const void* m;
  int64_t block_kind;  // the block kernel's kind (0: Q4, 1: Q8)
  int64_t block_rows;  // steps of up to this many rows read the blocks
  const float* bias;  // [N] float32, or null
  const int64_t* perm;  // [K]: the blocks' column j is x's column perm[j] (act-order), or null
};

struct PagellmDecoderDims {  // the model's
  int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
  int64_t kind;  // of the activations, norm weights and KV cache: 0 float32, 1 bf16
  float eps, scale;
};

struct PagellmDecoderLayer {  // one layer
  const void* input_norm;  // [hidden], the activations' kind
  const void* post_norm;
  const void* q_norm;  // [D] or null (Qwen3)
  const void* k_norm;
  void* k_cache;  // [blocks, block_size, H_kv, D]
  void* v_cache;
  int64_t window;  // 0: none
  PagellmDecoderGemm qkv, o, gate_up, down;
};

struct PagellmDecoderLora {  // a step's adapter rows (lora_cpu.cpp's arguments)
  PagellmLoraFn add;
  const PagellmLoraPart* parts;  // [layers][4 projections][kLoraParts] (null `at`: none)
  int64_t max_rank;
  const int64_t* rows;  // sorted by group
  const PagellmLoraGroup* groups;
  int64_t num_groups;
};

struct PagellmDecoderStep {
  int64_t tokens;
  void* x;    // [T, hidden]: the embeddings in, the last layer's output out
  void* res;  // [T, hidden]: the residual stream out
  void* normed;  // [T, hidden] scratch
  void* qkv;  // [T, (H + 2 H_kv) D]
  void* qk;   // [T, H + H_kv, D]
  void* attn;  // [T, H, D]
  void* gate_up;  // [T, 2 I]
  void* act;  // [T, I]
  const void* cos_sin;  // [T, D], the activations' kind
  const int64_t* slots;  // [T] cache slots of this step's keys
  const int32_t* block_table;
  int64_t block_table_stride;
  const int64_t* rows;  // the attention's query rows, their requests and key counts
  const int64_t* reqs;
  const int32_t* lens;
  int64_t num_rows;
  const PagellmDecoderLora* lora;  // null: no adapter rows this step
};

}  // extern "C"

namespace {

// y [T, N] = x [T, K] @ W^T (+ bias), rows contiguous; 0: done
int project(const PagellmDecoderFns* f, const PagellmDecoderGemm& g, const char* x, int64_t T,
            int64_t K, int64_t N, char* y, int kind) {
  const size_t es = kind == 1 ? 2 : 4;
  if (g.qs && T <= g.block_rows && f->block_gemm) {
    std::vector<char> gathered;  // act-order: x's columns in the blocks' order
    if (g.perm) {
      gathered.resize(size_t(T * K) * es);
      for (int64_t i = 0; i < T * K; ++i) {
        const int64_t from = i / K * K + g.perm[i % K];
        std::memcpy(gathered.data() + i * es, x + from * es, es);
      }
      x = gathered.data();
    }
    for (int64_t t = 0; t < T; t += kBlockRows) {
      const int64_t rows = T - t < kBlockRows ? T - t : kBlockRows;
      if (f->block_gemm(x + t * K * es, rows, K, kind, int(g.block_kind), g.qs, g.d, g.m, N,
                        y + t * N * es, g.bias)) {
        return 1;
      }
    }
    return 0;
  }
  const GemmFn gemm = kind == 1 ? f->gemm : f->gemm_f32;
  if (!g.panels || !gemm) return 1;
  return gemm(x, K, T, K, g.panels, N, g.bias, y, N) ? 1 : 0;
}

// y's rows += their adapters' deltas for projection p of layer l (qkv, o, gate_up, down)
int add_lora(const PagellmDecoderLora* lo, int64_t l, int64_t p, const char* x, int64_t K,
             char* y, int64_t N, int kind) {
  if (!lo) return 0;
  return lo->add(x, K, y, N, lo->parts + (l * 4 + p) * kLoraParts, kLoraParts, lo->max_rank,
                 lo->rows, lo->groups, lo->num_groups, kind);
}

}  // namespace

extern "C" {

// 0: done; 1: a GEMM could not run (no weight layout for this step's rows, or refused)
int pagellm_decoder_layers(const PagellmDecoderFns* f, const PagellmDecoderDims* d,
                           const PagellmDecoderLayer* layers, int64_t num_layers,
                           const PagellmDecoderStep* s) {
  const int64_t T = s->tokens, H = d->hidden, D = d->head_dim, heads = d->heads;
  const int64_t kv = d->kv_heads, I = d->intermediate;
  const int64_t qkv_cols = (heads + 2 * kv) * D, kv_row = kv * D;
  const int kind = int(d->kind);
  const size_t es = kind == 1 ? 2 : 4;
  char* x = static_cast<char*>(s->x);
  char* normed = static_cast<char*>(s->normed);
  char* qkv = static_cast<char*>(s->qkv);
  char* qk = static_cast<char*>(s->qk);
  char* attn = static_cast<char*>(s->attn);
  char* gate_up = static_cast<char*>(s->gate_up);
  char* act = static_cast<char*>(s->act);
  // strides (token, head) in elements, as the kernels take them
  const int64_t flat[8] = {H, 0, H, 0, H, 0, H, 0};
  const int64_t rot[5] = {qkv_cols, D, (heads + kv) * D, D, D};
  const int64_t heads_norm[8] = {qkv_cols, D, qkv_cols, D, qkv_cols, D, qkv_cols, D};
  const int64_t silu[2] = {2 * I, I};
  const int64_t attn_strides[8] = {(heads + kv) * D, D, heads * D, D, d->block_size * kv_row,
                                   kv_row, D, s->block_table_stride};
  const int32_t dims[7] = {int32_t(heads), int32_t(kv), int32_t(D), int32_t(d->block_size), 0,
                           kind, kind};
  for (int64_t l = 0; l < num_layers; ++l) {
    const PagellmDecoderLayer& L = layers[l];
    if (l == 0) {  // the residual stream starts as the embeddings
      std::memcpy(s->res, x, size_t(T * H) * es);
      f->rms_norm(normed, nullptr, x, nullptr, L.input_norm, T, 1, H, flat, d->eps, kind);
    } else {
      f->rms_norm(normed, s->res, x, s->res, L.input_norm, T, 1, H, flat, d->eps, kind);
    }
    if (project(f, L.qkv, normed, T, H, qkv_cols, qkv, kind)) return 1;
    if (add_lora(s->lora, l, 0, normed, H, qkv, qkv_cols, kind)) return 1;
    if (L.q_norm) {  // in place, per head (the kernel reads a row before writing it)
      char* k = qkv + heads * D * es;
      f->rms_norm(qkv, nullptr, qkv, nullptr, L.q_norm, T, heads, D, heads_norm, d->eps, kind);
      f->rms_norm(k, nullptr, k, nullptr, L.k_norm, T, kv, D, heads_norm, d->eps, kind);
    }
    f->rotary(qk, qkv, s->cos_sin, T, heads + kv, D / 2, D, rot, kind);
    for (int64_t t = 0; t < T; ++t) {  // this step's keys and values into the cache
      const int64_t slot = s->slots[t];
      if (slot < 0) continue;  // a padding row: nothing to store (as reshape_and_cache)
      std::memcpy(static_cast<char*>(L.k_cache) + slot * kv_row * es,
                  qk + (t * (heads + kv) + heads) * D * es, size_t(kv_row) * es);
      std::memcpy(static_cast<char*>(L.v_cache) + slot * kv_row * es,
                  qkv + (t * qkv_cols + (heads + kv) * D) * es, size_t(kv_row) * es);
    }
    int32_t layer_dims[7];
    std::memcpy(layer_dims, dims, sizeof dims);
    layer_dims[4] = int32_t(L.window);
    f->attention(attn, qk, L.k_cache, L.v_cache, s->block_table, s->rows, s->reqs, s->lens,
                 s->num_rows, attn_strides, layer_dims, nullptr, d->scale, 1.f, 0.f,
                 nullptr);  // no sinks: a model with sinks takes its layers
    if (project(f, L.o, attn, T, heads * D, H, x, kind)) return 1;
    if (add_lora(s->lora, l, 1, attn, heads * D, x, H, kind)) return 1;
    f->rms_norm(normed, s->res, x, s->res, L.post_norm, T, 1, H, flat, d->eps, kind);
    if (project(f, L.gate_up, normed, T, H, 2 * I, gate_up, kind)) return 1;
    if (add_lora(s->lora, l, 2, normed, H, gate_up, 2 * I, kind)) return 1;
    f->silu_and_mul(act, gate_up, T, I, silu, kind);
    if (project(f, L.down, act, T, I, H, x, kind)) return 1;
    if (add_lora(s->lora, l, 3, act, I, x, H, kind)) return 1;
  }
  return 0;
}

}  // extern "C"
