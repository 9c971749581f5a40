// The arguments of lora_cpu.cpp's entry point, shared with the decoder loop (cpu_decoder.cpp)
// that calls it through a pointer; pagellm/kernels/lora_cpu.py mirrors them with ctypes.
#pragma once

#include <cstdint>

extern "C" {

struct PagellmLoraGroup {  // rows[first .. first + count) use slot `slot`
  int64_t slot, first, count, rank;
  float scale;
};

struct PagellmLoraPart {  // one output part of a projection (null `at`: none)
  const void* at;  // [slots, K, R]
  const void* bt;  // [slots, R, cols]
  const uint8_t* present;  // [slots]
  int64_t start, cols;  // its output columns
};

// y [T, ldy] (its parts' columns) += each grouped row's delta; x [T, K] rows contiguous.
// kind: 0 float32, 1 bf16 (x, y and the weights). 0: done; 1: a rank over R.
using PagellmLoraFn = int (*)(const void* x, int64_t K, void* y, int64_t ldy,
                              const PagellmLoraPart* parts, int64_t num_parts, int64_t R,
                              const int64_t* rows, const PagellmLoraGroup* groups,
                              int64_t num_groups, int kind);

}  // extern "C"
