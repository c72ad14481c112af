// What decode.cpp shares with the deepseek_v41 step (v41.cpp): a linear as the kernels read it, the products, the
// norm and the second thread. Both files are compiled into one library (ced/kernels/__init__.py).
#pragma once

// A linear of the model: its packed weight (float32, or bfloat16 where `bf16`) and, where it has LoRA slots, the
// slots' packed A (in, rank) and B (rank, out), a_stride / b_stride floats apart (a == nullptr: none). Mirrored by
// LinearSpec.
struct Linear {
  const void* panels;
  long in, out;
  const float* a;
  long a_stride;
  const float* b;
  long b_stride;
  long rank;
  const char* used;  // per slot: whether that slot's adapter adapts this linear (null: every slot does)
  long bf16;         // nonzero: `panels` holds bfloat16 weights
};

extern "C" {
int linear(const Linear* L, const float* x, long ldx, int M, const long* slots, float* y, long ldy);
void rms_norm(const float* x, int M, long C, const float* w, float eps, float* y);
}

namespace kernels {

typedef unsigned short bf16;  // a bfloat16's bits
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned access to 16 floats

inline v16 load(const float* p) { return *(const v16u*)p; }
inline void store(float* p, v16 v) { *(v16u*)p = v; }

// sum_i a[i] * b[i]: 16 lanes of partial sums while 16 remain, added lane by lane, then the rest in order (a fixed
// order for a given n: the same bits for every call).
inline float dot(const float* a, const float* b, long n) {
  v16 acc = {};
  long i = 0;
  for (; i + 16 <= n; i += 16) acc += load(a + i) * load(b + i);
  float sum = 0.0f;
  for (int lane = 0; lane < 16; ++lane) sum += acc[lane];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// run(f, i) for i in [0, n), parts claimed by this thread and the worker where `worth_it` (decode.cpp's parallel).
void parallel_parts(long n, bool worth_it, void (*run)(void*, long), void* f);

template <class F>
void parallel_for(long n, bool worth_it, F&& f) {
  parallel_parts(n, worth_it, [](void* g, long i) { (*static_cast<F*>(g))(i); }, &f);
}

}  // namespace kernels
