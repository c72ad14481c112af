// What decode.cpp shares with the deepseek_v41 step (v41.cpp): a linear as the kernels read it, the products, the
// norm, e^x and SwiGLU 16 lanes at a time, and the second thread. Both files are compiled into one library
// (ced/kernels/__init__.py).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

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

// e^x in each of 16 lanes: 2^n p(r), n = x / ln 2 rounded, r = x - n ln 2 (in two parts), p Cephes' degree-6
// polynomial: within 2 ulp of std::exp (checked over [-87.3, 88.7] in steps of 0.0007); 0 below ln FLT_MIN (no
// subnormals), +inf above ln FLT_MAX. A lane's bits depend on its own input only, so a softmax gives each row the
// same bits in any batch.
inline v16 exp16(v16 x) {
  typedef int i16 __attribute__((vector_size(64)));
  const v16 high = (v16){} + 88.72283f, low = (v16){} - 87.33654f, shift = (v16){} + 12582912.0f;  // rounds
  const i16 over = x > high, under = x < low;
  x = over ? high : under ? low : x;
  const v16 n = (x * 1.44269504f + shift) - shift;
  const v16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  v16 p = (v16){} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f, p = p * r + 8.3334519073e-3f, p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f, p = p * r + 5.0000001201e-1f;
  const v16 y = (p * (r * r) + r) + 1.0f;
  const i16 k = __builtin_convertvector(n, i16);  // 2^k in two factors where 2^k alone would overflow (k = 128)
  const v16 scaled = k > 0 ? (y * 2.0f) * (v16)((k + 126) << 23) : y * (v16)((k + 127) << 23);
  return over ? (v16){} + INFINITY : under ? (v16){} : scaled;
}

// w[j] = e^(w[j] - top) for j < n, 16 at a time (the last ones padded).
inline void exp_shifted(float* w, long n, float top) {
  long j = 0;
  for (; j + 16 <= n; j += 16) store(w + j, exp16(load(w + j) - top));
  if (j < n) {
    float tail[16] = {};
    std::memcpy(tail, w + j, (n - j) * sizeof(float));
    const v16 e = exp16(load(tail) - top);
    std::memcpy(w + j, &e, (n - j) * sizeof(float));
  }
}

// g[i] = silu(g[i]) * u[i] for i < n, g clamped above and u both ways at `limit` where it is set (> 0; 0: not); 16
// at a time, the last ones padded, so an element's bits do not depend on where it lies (a row's, in any batch).
inline void swiglu(float* g, const float* u, long n, float limit) {
  auto sixteen = [limit](v16 gate, v16 up) {
    if (limit > 0) {
      gate = gate > limit ? (v16){} + limit : gate;
      up = up > limit ? (v16){} + limit : up < -limit ? (v16){} - limit : up;
    }
    return gate / (1.0f + exp16(-gate)) * up;
  };
  long i = 0;
  for (; i + 16 <= n; i += 16) store(g + i, sixteen(load(g + i), load(u + i)));
  if (i < n) {
    float gate[16] = {}, up[16] = {};
    std::memcpy(gate, g + i, (n - i) * sizeof(float));
    std::memcpy(up, u + i, (n - i) * sizeof(float));
    const v16 out = sixteen(load(gate), load(up));
    std::memcpy(g + i, &out, (n - i) * sizeof(float));
  }
}

// A call's temporaries from a per-thread arena (decode.cpp): a deepseek_v41 decode step makes ~400 small buffers,
// and malloc and free cost it ~20 us on the caches its weights leave. Blocks are bumped off the arena's top; a
// freed block that is the top gives its bytes back at once (a step's buffers die in reverse order), and the whole
// arena is free again once nothing in it lives. A block that does not fit comes from malloc.
void* scratch_alloc(std::size_t bytes);
void scratch_free(void* p, std::size_t bytes);

template <class T>
struct ScratchAllocator {
  typedef T value_type;
  ScratchAllocator() = default;
  template <class U>
  ScratchAllocator(const ScratchAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(scratch_alloc(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) { scratch_free(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const ScratchAllocator<U>&) const { return true; }
};

template <class T>
using scratch = std::vector<T, ScratchAllocator<T>>;

// run(f, i) for i in [0, n), parts claimed by this thread and the worker where `worth_it` (decode.cpp's parallel).
void parallel_parts(long n, bool worth_it, void (*run)(void*, long), void* f);

template <class F>
void parallel_for(long n, bool worth_it, F&& f) {
  parallel_parts(n, worth_it, [](void* g, long i) { (*static_cast<F*>(g))(i); }, &f);
}

}  // namespace kernels
