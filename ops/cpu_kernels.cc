// Products of a decode or verify step on XLA:CPU, as XLA FFI handlers (ops/matvec.py registers them).
//
// XLA:CPU runs a product under ~2 MB on one core, the larger ones below the bandwidth two cores reach, and
// YNNPACK's products of a few rows on one core (benchmarks/RESULTS.md). These split every product across the
// calling thread and XLA's intra-op pool, each thread streaming its own contiguous weight rows, as llama.cpp splits
// a product across its threads, and read each weight once for all of a step's rows. Float32 activations, float32 or
// int8 weights; AVX2 + FMA on x86-64 (setup.py), and AVX-512's registers for the few-row loops where the CPU has
// them (`HasAvx512`).
//
//   linnet_xw: y[T, N] = x[T, K] · w[K, N]   (projections stored input-first; one x with any number of w, each its y)
//   linnet_wx: y[T, N] = x[T, K] · w[N, K]ᵀ  (the lm head, stored [vocab, embed])
//   linnet_xw_int8: y[T, N] = x[T, K] · (q[K, N] scaled by s[K / G, N])   (weight-only int8: each output's inputs
//   linnet_wx_int8: y[T, N] = x[T, K] · (q[N, K] scaled by s[N, K / G])ᵀ  in blocks of G, one scale a block; x by
//                                                                         int8 digits where the CPU has VNNI, else
//                                                                         each weight widened once for the rows T;
//                                                                         xw: any number of (q, s), each its y)
//   linnet_abt: y[N, I, J] = a[N, I, C] · b[N, J, C]ᵀ per n   (attention's scores and mixing for a few query rows,
//                                                             over each row's filled slots only: each key or value
//                                                             read once for all of them)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Matrix = ffi::Buffer<ffi::F32, 2>;
using MatrixResult = ffi::ResultBuffer<ffi::F32, 2>;
using Int8Matrix = ffi::Buffer<ffi::S8, 2>;
using Int32Vector = ffi::Buffer<ffi::S32, 1>;
using Cube = ffi::Buffer<ffi::F32, 3>;
using CubeResult = ffi::ResultBuffer<ffi::F32, 3>;

constexpr int64_t kMinRowsPerPart = 64;  // below this a part costs more to hand over than to run

// row[0:k] · x[0:k], eight partial sums.
inline float Dot(const float* row, const float* x, int64_t k) {
  float sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= k; j += 8)
    for (int l = 0; l < 8; ++l) sums[l] += row[j + l] * x[j + l];
  float total = 0;
  for (; j < k; ++j) total += row[j] * x[j];
  for (float s : sums) total += s;
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)
#define LINNET_AVX2 1
#endif

// Brings the cache line at p into L2 ahead of its use (the hardware's L1 prefetchers take it on from there). Into L2
// rather than L1: the kernels prefetch a group of weight rows at a time, more lines than L1 can have in flight, and on
// an AMD Zen 4 machine (benchmarks/RESULTS.md) the lm head then streamed 25% faster, float32 and int8.
inline void PrefetchToL2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Eight (V8, AVX2's registers) or sixteen (V16, AVX-512's) float lanes as GCC's vector extensions, loaded and stored
// at any alignment.
#pragma GCC diagnostic ignored "-Wpsabi"  // V16 passed between always-inlined helpers only: no call ever uses the ABI
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's avx512fintrin.h (_mm512_undefined: its bug 105593)
typedef float V8 __attribute__((vector_size(32)));
typedef float V16 __attribute__((vector_size(64)));

template <typename V>
__attribute__((always_inline)) inline V Load(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
__attribute__((always_inline)) inline void Store(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof(V));
}

// Whether this CPU has AVX-512 (the kernels below then use its registers).
bool HasAvx512() {
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512;
#else
  return false;
#endif
}

// A loop's clone for this CPU: name##Avx512 where it has AVX-512, else name##Avx2 (V8's lanes, any CPU).
#if defined(__x86_64__)
#define FOR_THIS_CPU(name) (HasAvx512() ? name##Avx512 : name##Avx2)
#else
#define FOR_THIS_CPU(name) name##Avx2
#endif

#ifdef LINNET_AVX2
// Four vectors' sums: [Σ s0, Σ s1, Σ s2, Σ s3].
inline __m128 SumLanes(V8 s0, V8 s1, V8 s2, V8 s3) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps((__m256)s0, (__m256)s1), _mm256_hadd_ps((__m256)s2, (__m256)s3));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

__attribute__((always_inline)) inline V8 Fold(V8 v) { return v; }

__attribute__((always_inline)) inline V8 Fold(V16 v) {  // the two halves added
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}

// The first `count` (< L) floats at p, then zeros: a depth's last, partial vector, summed in the same lanes as a whole
// one would be.
template <typename V>
__attribute__((always_inline)) inline V LoadPartial(const float* p, int64_t count) {
  float padded[sizeof(V) / sizeof(float)] = {};
  __builtin_memcpy(padded, p, count * sizeof(float));
  return Load<V>(padded);
}

// y[i, 0:4] (i < kRows, y's rows `stride` apart) = a's rows (c apart) · b0..b3 (c apart) over 0:depth, V's lanes at
// a time, element p always in lane p % L: terms past the last nonzero one add exact zeros, so a row's sums do not
// depend on how far depth reaches past them (attention's mixing over a row's filled slots).
template <typename V, int kRows>
__attribute__((always_inline)) inline void DotGroup(const float* a, int64_t c, const float* b0, int64_t depth,
                                                    float* y, int64_t stride) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  const float *b1 = b0 + c, *b2 = b1 + c, *b3 = b2 + c;
  V s[kRows][4] = {};
  const auto add = [&](V w0, V w1, V w2, V w3, int i, V x) {
    s[i][0] += w0 * x;
    s[i][1] += w1 * x;
    s[i][2] += w2 * x;
    s[i][3] += w3 * x;
  };
  const int64_t vector_depth = depth - depth % kLanes, rest = depth - vector_depth;
  for (int64_t p = 0; p < vector_depth; p += kLanes) {
    const V w0 = Load<V>(b0 + p), w1 = Load<V>(b1 + p), w2 = Load<V>(b2 + p), w3 = Load<V>(b3 + p);
    for (int i = 0; i < kRows; ++i) add(w0, w1, w2, w3, i, Load<V>(a + i * c + p));
  }
  if (rest) {
    const int64_t p = vector_depth;
    const V w0 = LoadPartial<V>(b0 + p, rest), w1 = LoadPartial<V>(b1 + p, rest), w2 = LoadPartial<V>(b2 + p, rest),
            w3 = LoadPartial<V>(b3 + p, rest);
    for (int i = 0; i < kRows; ++i) add(w0, w1, w2, w3, i, LoadPartial<V>(a + i * c + p, rest));
  }
  for (int i = 0; i < kRows; ++i)
    _mm_storeu_ps(y + i * stride, SumLanes(Fold(s[i][0]), Fold(s[i][1]), Fold(s[i][2]), Fold(s[i][3])));
}

// DotRowGroups' vector part for j in j0..j1 - (j1 - j0) % 4, kRows rows of a per pass over a group (as many as
// V's registers hold the sums of); returns where it stopped.
template <typename V, int kRows>
__attribute__((always_inline)) inline int64_t DotGroups(const float* a, int64_t rows, const float* b, int64_t c,
                                                        int64_t depth, float* y, int64_t stride, int64_t j0,
                                                        int64_t j1) {
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) {
    if (j + 8 <= j1)  // the next group's rows, on their way while this one is summed
      for (int64_t p = 0; p < 4 * c; p += 16) PrefetchToL2(b + (j + 4) * c + p);
    int64_t i = 0;
    for (; i + kRows <= rows; i += kRows) DotGroup<V, kRows>(a + i * c, c, b + j * c, depth, y + i * stride + j, stride);
    for (; i < rows; ++i) DotGroup<V, 1>(a + i * c, c, b + j * c, depth, y + i * stride + j, stride);
  }
  return j;
}

int64_t DotGroupsAvx2(const float* a, int64_t rows, const float* b, int64_t c, int64_t depth, float* y,
                      int64_t stride, int64_t j0, int64_t j1) {
  return DotGroups<V8, 2>(a, rows, b, c, depth, y, stride, j0, j1);
}

__attribute__((target("avx512f"))) int64_t DotGroupsAvx512(const float* a, int64_t rows, const float* b, int64_t c,
                                                           int64_t depth, float* y, int64_t stride, int64_t j0,
                                                           int64_t j1) {
  return DotGroups<V16, 4>(a, rows, b, c, depth, y, stride, j0, j1);
}
#endif

// y[i, j] = a[i, 0:depth] · b[j, 0:depth] for i < rows and j in j0..j1 (a's and b's rows c apart, y's `stride`
// apart): four rows of b at a time, each group dotted with every row of a (two at a time) while it sits in L1.
void DotRowGroups(const float* a, int64_t rows, const float* b, int64_t c, int64_t depth, float* y, int64_t stride,
                  int64_t j0, int64_t j1) {
  int64_t j = j0;
#ifdef LINNET_AVX2
  j = FOR_THIS_CPU(DotGroups)(a, rows, b, c, depth, y, stride, j0, j1);
#endif
  for (; j < j1; ++j)
    for (int64_t i = 0; i < rows; ++i) y[i * stride + j] = Dot(b + j * c, a + i * c, depth);
}

constexpr int64_t kBatchWeightRows = 16;  // weight rows streamed side by side, each read from memory once

// y[t, 0:2L] += x[t, r:r + kBatchWeightRows] · w[r:r + kBatchWeightRows, 0:2L] for the kRows rows t of x (x's rows k
// apart, w's and y's n apart), L the lanes of V.
template <typename V, int kRows>
__attribute__((always_inline)) inline void AddPanel(const float* x, int64_t k, const float* w, int64_t n, float* y,
                                                    int64_t r) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  V lo[kRows], hi[kRows];
  for (int t = 0; t < kRows; ++t) {
    lo[t] = Load<V>(y + t * n);
    hi[t] = Load<V>(y + t * n + kLanes);
  }
  for (int64_t i = r; i < r + kBatchWeightRows; ++i) {
    const V w0 = Load<V>(w + i * n), w1 = Load<V>(w + i * n + kLanes);
    for (int t = 0; t < kRows; ++t) {
      const float xt = x[t * k + i];
      lo[t] += w0 * xt;
      hi[t] += w1 * xt;
    }
  }
  for (int t = 0; t < kRows; ++t) {
    Store(y + t * n, lo[t]);
    Store(y + t * n + kLanes, hi[t]);
  }
}

// y[0:rows, j:j+2L] += x[0:rows, r:r + kBatchWeightRows] · w[r:r + kBatchWeightRows, j:j+2L] for j < n - n % 2L,
// four rows of y at a time; returns n - n % 2L. The `ahead` rows after the group (none where ahead ≤ 0) are
// prefetched a panel at a time, as AddScaledPanels does (a 16-row step 10-16% shorter on an AMD Zen 4 machine).
template <typename V>
__attribute__((always_inline)) inline int64_t AddPanels(const float* x, int64_t k, int64_t rows, const float* w,
                                                        float* y, int64_t n, int64_t r, int64_t ahead) {
  constexpr int64_t kWidth = 2 * sizeof(V) / sizeof(float);
  const int64_t vector_n = n - n % kWidth;
  const float* next = w + (r + kBatchWeightRows) * n;
  for (int64_t j = 0; j < vector_n; j += kWidth) {
    for (int64_t i = 0; i < ahead; ++i)
      for (int64_t p = 0; p < kWidth; p += 16) PrefetchToL2(next + i * n + j + p);
    int64_t t = 0;
    for (; t + 4 <= rows; t += 4) AddPanel<V, 4>(x + t * k, k, w + j, n, y + t * n + j, r);
    switch (rows - t) {
      case 3: AddPanel<V, 3>(x + t * k, k, w + j, n, y + t * n + j, r); break;
      case 2: AddPanel<V, 2>(x + t * k, k, w + j, n, y + t * n + j, r); break;
      case 1: AddPanel<V, 1>(x + t * k, k, w + j, n, y + t * n + j, r); break;
      default: break;
    }
  }
  return vector_n;
}

int64_t AddPanelsAvx2(const float* x, int64_t k, int64_t rows, const float* w, float* y, int64_t n, int64_t r,
                      int64_t ahead) {
  return AddPanels<V8>(x, k, rows, w, y, n, r, ahead);
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) int64_t AddPanelsAvx512(const float* x, int64_t k, int64_t rows, const float* w,
                                                           float* y, int64_t n, int64_t r, int64_t ahead) {
  return AddPanels<V16>(x, k, rows, w, y, n, r, ahead);
}
#endif

// y[0:rows, 0:n] = x[0:rows, r0:r1] · w[r0:r1, 0:n] (x [rows, k]): kBatchWeightRows weight rows at a time, streamed
// side by side a panel of columns at a time, each panel added into every row of y, four rows at a time (with
// AVX-512's registers where the CPU has them).
void AccumulateBatch(const float* x, int64_t k, int64_t rows, const float* w, float* y, int64_t n, int64_t r0,
                     int64_t r1) {
  const auto add_panels = FOR_THIS_CPU(AddPanels);
  std::memset(y, 0, rows * n * sizeof(float));
  int64_t r = r0;
  for (; r + kBatchWeightRows <= r1; r += kBatchWeightRows) {
    const int64_t ahead = std::min(kBatchWeightRows, r1 - r - kBatchWeightRows);
    const int64_t vector_n = add_panels(x, k, rows, w, y, n, r, ahead);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t i = r; i < r + kBatchWeightRows; ++i)
        for (int64_t j = vector_n; j < n; ++j) y[t * n + j] += x[t * k + i] * w[i * n + j];
  }
  for (; r < r1; ++r)
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < n; ++j) y[t * n + j] += x[t * k + r] * w[r * n + j];
}

// L int8 values at q as floats, L the lanes of V (the tag's type). Not always_inline: inlined where the caller's
// target has AVX-512 (the loops below, instantiated for V16 inside target("avx512f") functions).
inline V8 Widen(const int8_t* q, V8) {
#ifdef LINNET_AVX2
  return (V8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
#else
  V8 v;
  for (int l = 0; l < 8; ++l) v[l] = q[l];
  return v;
#endif
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) inline V16 Widen(const int8_t* q, V16) {
  return (V16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}
#endif

// L weights at p as floats: int8 ones widened, or float ones already widened into a buffer (the int8 loops read a
// weight from its int8 row for one row of x, and widen it once into a buffer for several: the same sums either way).
template <typename V>
__attribute__((always_inline)) inline V Fetch(const int8_t* p) {
  return Widen(p, V());
}

template <typename V>
__attribute__((always_inline)) inline V Fetch(const float* p) {
  return Load<V>(p);
}

constexpr int64_t kInt8Panel = 4;  // vectors of columns per pass over a group of weight rows: four chains of sums

// y[0:4L] += scale[0:4L] * Σ_i<m x[i] w[i, 0:4L] (w's rows `stride` apart, int8 or widened): the sums in registers.
template <typename V, typename W>
__attribute__((always_inline)) inline void AddScaledPanel(const float* x, const W* w, int64_t stride, int64_t m,
                                                          const float* scale, float* y) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  V sums[kInt8Panel] = {};
  for (int64_t i = 0; i < m; ++i)
    for (int p = 0; p < kInt8Panel; ++p) sums[p] += Fetch<V>(w + i * stride + p * kLanes) * x[i];
  for (int p = 0; p < kInt8Panel; ++p)
    Store(y + p * kLanes, Load<V>(y + p * kLanes) + sums[p] * Load<V>(scale + p * kLanes));
}

// y[t, 0:n'] += scale[0:n'] * x[t, r:r+m] · q[r:r+m, 0:n'] for t < rows (x's rows k apart, q's and y's n apart; m ≤
// kBatchWeightRows), n' = n - n % 4L, which it returns: one row straight from q, several from each panel widened once.
// The `ahead` rows after the group are prefetched a panel at a time (a panel's rows are short streams, too short for
// the hardware's prefetchers to learn).
template <typename V>
__attribute__((always_inline)) inline int64_t AddScaledPanels(const float* x, int64_t k, int64_t rows, const int8_t* q,
                                                              const float* scale, float* y, int64_t n, int64_t r,
                                                              int64_t m, int64_t ahead) {
  constexpr int64_t kWidth = kInt8Panel * sizeof(V) / sizeof(float);
  const int64_t vector_n = n - n % kWidth;
  const int8_t* group = q + r * n;
  for (int64_t j = 0; j < vector_n; j += kWidth) {
    for (int64_t i = m; i < m + ahead; ++i)
      for (int64_t p = 0; p < kWidth; p += 64) PrefetchToL2(group + i * n + j + p);
    if (rows == 1) {
      AddScaledPanel<V>(x + r, group + j, n, m, scale + j, y + j);
      continue;
    }
    float panel[kBatchWeightRows * kWidth];
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = 0; p < kWidth; p += kWidth / kInt8Panel) Store(panel + i * kWidth + p, Fetch<V>(group + i * n + j + p));
    for (int64_t t = 0; t < rows; ++t) AddScaledPanel<V>(x + t * k + r, panel, kWidth, m, scale + j, y + t * n + j);
  }
  return vector_n;
}

int64_t AddScaledPanelsAvx2(const float* x, int64_t k, int64_t rows, const int8_t* q, const float* scale, float* y,
                            int64_t n, int64_t r, int64_t m, int64_t ahead) {
  return AddScaledPanels<V8>(x, k, rows, q, scale, y, n, r, m, ahead);
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) int64_t AddScaledPanelsAvx512(const float* x, int64_t k, int64_t rows,
                                                                 const int8_t* q, const float* scale, float* y,
                                                                 int64_t n, int64_t r, int64_t m, int64_t ahead) {
  return AddScaledPanels<V16>(x, k, rows, q, scale, y, n, r, m, ahead);
}
#endif

// y[t, 0:n] = x[t, r0:r1] · (q[r0:r1, 0:n] scaled by s, a row of scales per block of `block` input rows) for t <
// rows (x [rows, k]): up to kBatchWeightRows weight rows of a block at a time, streamed side by side, summed a panel
// of columns at a time in registers, then scaled and added into y. A row's sums do not depend on the other rows.
void AccumulateInt8(const float* x, int64_t k, int64_t rows, const int8_t* q, const float* s, float* y, int64_t n,
                    int64_t block, int64_t r0, int64_t r1) {
  const auto add_panels = FOR_THIS_CPU(AddScaledPanels);
  std::memset(y, 0, rows * n * sizeof(float));
  for (int64_t r = r0, m; r < r1; r += m) {
    m = std::min({kBatchWeightRows, r1 - r, (r / block + 1) * block - r});
    const float* scale = s + (r / block) * n;
    const int64_t vector_n = add_panels(x, k, rows, q, scale, y, n, r, m, std::min(kBatchWeightRows, r1 - r - m));
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = vector_n; j < n; ++j) {
        float sum = 0;
        for (int64_t i = r; i < r + m; ++i) sum += x[t * k + i] * q[i * n + j];
        y[t * n + j] += sum * scale[j];
      }
  }
}

#ifdef LINNET_AVX2
// y[0:4] = Σ over blocks b of s[i, b] * (w[i, block b] · x[block b]) for the four rows i of w (w_stride apart, int8 or
// widened; s's rows `blocks` apart; block a multiple of L): a chain of sums per row, L lanes at a time.
template <typename V, typename W>
__attribute__((always_inline)) inline void DotScaledGroup(const W* w, int64_t w_stride, const float* s, int64_t blocks,
                                                          const float* x, int64_t k, int64_t block, float* y) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  V total[4] = {};
  for (int64_t start = 0, b = 0; start < k; start += block, ++b) {
    V part[4] = {};
    for (int64_t j = start; j < start + block; j += kLanes) {
      const V xj = Load<V>(x + j);
      for (int i = 0; i < 4; ++i) part[i] += Fetch<V>(w + i * w_stride + j) * xj;
    }
    for (int i = 0; i < 4; ++i) total[i] += part[i] * s[i * blocks + b];
  }
  _mm_storeu_ps(y, SumLanes(Fold(total[0]), Fold(total[1]), Fold(total[2]), Fold(total[3])));
}

constexpr int64_t kGroupsAhead = 4;  // how far ahead DotScaledRows prefetches: about as many bytes as DotGroups

// y[t, r:r+4] = (q[r:r+4, 0:k] scaled, s [n, k / block]) · x[t, 0:k] for t < rows (y [rows, n]) and each group of four
// rows r in r0..r1 - (r1 - r0) % 4, where it stops: one row of x straight from q, several from each group widened once
// into a buffer; the next group's rows prefetched.
template <typename V>
__attribute__((always_inline)) inline int64_t DotScaledRows(const float* x, int64_t rows, const int8_t* q,
                                                            const float* s, float* y, int64_t n, int64_t k,
                                                            int64_t block, int64_t r0, int64_t r1) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  const int64_t blocks = k / block;
  thread_local std::vector<float> buffer;
  buffer.resize(4 * k);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const int8_t* group = q + r * k;
    if (r + 4 * (kGroupsAhead + 1) <= r1)
      for (int64_t p = 0; p < 4 * k; p += 64) PrefetchToL2(group + kGroupsAhead * 4 * k + p);
    if (rows == 1) {
      DotScaledGroup<V>(group, k, s + r * blocks, blocks, x, k, block, y + r);
      continue;
    }
    for (int64_t j = 0; j < 4 * k; j += kLanes) Store(buffer.data() + j, Fetch<V>(group + j));
    for (int64_t t = 0; t < rows; ++t)
      DotScaledGroup<V>(buffer.data(), k, s + r * blocks, blocks, x + t * k, k, block, y + t * n + r);
  }
  return r;
}

int64_t DotScaledRowsAvx2(const float* x, int64_t rows, const int8_t* q, const float* s, float* y, int64_t n, int64_t k,
                          int64_t block, int64_t r0, int64_t r1) {
  return DotScaledRows<V8>(x, rows, q, s, y, n, k, block, r0, r1);
}

__attribute__((target("avx512f"))) int64_t DotScaledRowsAvx512(const float* x, int64_t rows, const int8_t* q,
                                                               const float* s, float* y, int64_t n, int64_t k,
                                                               int64_t block, int64_t r0, int64_t r1) {
  return DotScaledRows<V16>(x, rows, q, s, y, n, k, block, r0, r1);
}
#endif

// y[t, r] = (q[r, 0:k] scaled) · x[t, 0:k] for r in r0..r1 and t < rows, element by element where a block is not a
// whole number of the vector loops' steps.
void DotInt8Rows(const float* x, int64_t rows, const int8_t* q, const float* s, float* y, int64_t n, int64_t k,
                 int64_t block, int64_t r0, int64_t r1) {
  int64_t r = r0;
#ifdef LINNET_AVX2
  if (HasAvx512() && block % 16 == 0) {
    r = DotScaledRowsAvx512(x, rows, q, s, y, n, k, block, r0, r1);
  } else if (block % 8 == 0) {
    r = DotScaledRowsAvx2(x, rows, q, s, y, n, k, block, r0, r1);
  }
#endif
  for (; r < r1; ++r)
    for (int64_t t = 0; t < rows; ++t) {
      float total = 0;
      for (int64_t start = 0; start < k; start += block) {
        float part = 0;
        for (int64_t j = start; j < start + block; ++j) part += q[r * k + j] * x[t * k + j];
        total += s[r * (k / block) + start / block] * part;
      }
      y[t * n + r] = total;
    }
}

// ---- int8 weights times int8 digits of the activations (AVX-512 VNNI), where the CPU has it ----
//
// A row of activations x[0:k] becomes integers X = round(x · 2^22 / m), m the power of two at or above max |x| (so
// the scaling is exact and |X| ≤ 2^22), written in kDigits balanced base-256 digits, X = d0 + 256 d1 + 65536 d2 with
// each d in [-128, 127]. vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each four products into a
// 32-bit lane; with the weights as unsigned bytes u = q + 128 (q ^ 0x80), Σ q X = Σ_d 256^d Σ u d_d − 128 Σ X, exact
// in integers. So the one rounding before the scales is X's (at most 2^-23 m an input), and a row's sums depend on
// nothing but its own values: not its batch, the threads, or the order of the sums. Three 64-weight instructions
// (one a digit) do the work that widening the weights to float does in twelve.
#ifdef LINNET_AVX2
constexpr int kDigits = 3;
constexpr int kDigitScaleBits = 22;        // X = x · 2^22 / m
constexpr int64_t kMostSummedRows = 8192;  // an int32 lane sums at most this many inputs' products (< 2^31 / 255 / 128)
constexpr int64_t kDigitRows = 32;  // weight rows streamed side by side a pass over the columns (the next ones prefetched)

// Whether this CPU has AVX-512's byte operations and VNNI (vpdpbusd).
bool HasVnni() {
  static const bool vnni = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return vnni;
}

#define LINNET_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))

// A few rows of activations as digits: digits [rows, kDigits, k padded to a multiple of 64] (zeros past k), prefix
// [rows, k / 16 + 1] (Σ X over 0:16 i), unit [rows] (the value of X = 1: m / 2^22); k a multiple of 16.
struct Digits {
  int64_t padded = 0, per_row = 0;
  std::vector<int8_t> digits;
  std::vector<int64_t> prefix;
  std::vector<double> unit;

  const int8_t* Row(int64_t t, int d) const { return digits.data() + (t * kDigits + d) * padded; }
  // Σ X over r0:r1, multiples of 16
  int64_t Sum(int64_t t, int64_t r0, int64_t r1) const {
    return prefix[t * per_row + r1 / 16] - prefix[t * per_row + r0 / 16];
  }
};

// x [rows, k] as Digits (k a multiple of 16): the calling thread's, read by the parts it hands out before it returns.
LINNET_VNNI const Digits& ToDigits(const float* x, int64_t rows, int64_t k) {
  thread_local Digits out;
  out.padded = (k + 63) / 64 * 64;
  out.per_row = k / 16 + 1;
  out.digits.assign(rows * kDigits * out.padded, 0);
  out.prefix.assign(rows * out.per_row, 0);
  out.unit.resize(rows);
  for (int64_t t = 0; t < rows; ++t) {
    const float* row = x + t * k;
    __m512 most = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) most = _mm512_max_ps(most, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
    int exponent = 0;
    std::frexp(_mm512_reduce_max_ps(most), &exponent);  // max |x| < 2^exponent (0 for 0)
    exponent = std::max(exponent, kDigitScaleBits - 126);  // 2^(22 - exponent) a float: tinier rows lose digits
    out.unit[t] = std::ldexp(1.0, exponent - kDigitScaleBits);
    const __m512 scale = _mm512_set1_ps(std::ldexp(1.0f, kDigitScaleBits - exponent));
    int64_t* prefix = out.prefix.data() + t * out.per_row;
    for (int64_t i = 0; i < k; i += 16) {
      __m512i value = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + i), scale));  // exact product, rounded
      prefix[i / 16 + 1] = prefix[i / 16] + _mm512_reduce_add_epi32(value);
      for (int d = 0; d < kDigits; ++d) {
        const __m512i digit = _mm512_srai_epi32(_mm512_slli_epi32(value, 24), 24);  // the low byte, signed
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.digits.data() + (t * kDigits + d) * out.padded + i),
                         _mm512_cvtepi32_epi8(digit));
        value = _mm512_srai_epi32(_mm512_sub_epi32(value, digit), 8);
      }
    }
  }
  return out;
}

// Σ_d 256^d sums[d] − 128 x_sum (Σ q X, exact in doubles: |·| < 2^46) times X's unit, rounded to float once; for
// the 16 lanes of sums[·] (h = 0: lanes 0-7; 1: lanes 8-15).
LINNET_VNNI inline __m256 DigitSums(const __m512i (&sums)[kDigits], int h, int64_t x_sum, double unit) {
  __m512d total = _mm512_set1_pd(-128.0 * static_cast<double>(x_sum));
  for (int d = 0; d < kDigits; ++d)
    total = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(sums[d], h)),
                            _mm512_set1_pd(static_cast<double>(int64_t{1} << (8 * d))), total);
  return _mm512_cvtpd_ps(_mm512_mul_pd(total, _mm512_set1_pd(unit)));
}

// q[i:i+4, 0:64] (rows n apart; columns past `columns` read as 0) as unsigned bytes (q ^ 0x80) with each column's
// four rows side by side, so that lane (L, i) of interleaved[p] (L its 128-bit quarter) holds column 16 L + 4 p + i.
LINNET_VNNI inline void Interleave(const int8_t* q, int64_t n, __mmask64 columns, __m512i (&interleaved)[4]) {
  const __m512i flip = _mm512_set1_epi8(-128);
  __m512i u[4];
  for (int r = 0; r < 4; ++r) u[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(columns, q + r * n), flip);
  const __m512i lo01 = _mm512_unpacklo_epi8(u[0], u[1]), hi01 = _mm512_unpackhi_epi8(u[0], u[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(u[2], u[3]), hi23 = _mm512_unpackhi_epi8(u[2], u[3]);
  interleaved[0] = _mm512_unpacklo_epi16(lo01, lo23);
  interleaved[1] = _mm512_unpackhi_epi16(lo01, lo23);
  interleaved[2] = _mm512_unpacklo_epi16(hi01, hi23);
  interleaved[3] = _mm512_unpackhi_epi16(hi01, hi23);
}

// sums[p][d] += digit d's products of inputs i:i+4 with four interleaved rows (as Interleave leaves them).
LINNET_VNNI inline void AddDigits(const __m512i (&interleaved)[4], const int8_t* const (&digits)[kDigits], int64_t i,
                                  __m512i (&sums)[4][kDigits]) {
  for (int d = 0; d < kDigits; ++d) {
    int32_t four;
    std::memcpy(&four, digits[d] + i, sizeof(four));
    const __m512i digit = _mm512_set1_epi32(four);
    for (int p = 0; p < 4; ++p) sums[p][d] = _mm512_dpbusd_epi32(sums[p][d], interleaved[p], digit);
  }
}

// y[0:64] += scale[0:64] * each column's DigitSums (sums as AddDigits leaves them; columns past `count` untouched).
LINNET_VNNI inline void AddDigitPanelSums(const __m512i (&sums)[4][kDigits], int64_t x_sum, double unit,
                                          const float* scale, float* y, int64_t count) {
  __m512 v[4];
  for (int p = 0; p < 4; ++p)
    v[p] = _mm512_insertf32x8(_mm512_castps256_ps512(DigitSums(sums[p], 0, x_sum, unit)),
                              DigitSums(sums[p], 1, x_sum, unit), 1);
  // v[p]'s quarter L holds columns 16 L + 4 p + 0..3: the 4 × 4 quarters transposed into column order
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  const __m512 ordered[4] = {_mm512_shuffle_f32x4(t0, t2, 0x88), _mm512_shuffle_f32x4(t0, t2, 0xDD),
                             _mm512_shuffle_f32x4(t1, t3, 0x88), _mm512_shuffle_f32x4(t1, t3, 0xDD)};
  for (int l = 0; l < 4; ++l) {
    const int64_t left = std::clamp<int64_t>(count - 16 * l, 0, 16);
    const __mmask16 mask = left == 16 ? 0xFFFF : (1u << left) - 1;
    _mm512_mask_storeu_ps(y + 16 * l, mask, _mm512_fmadd_ps(ordered[l], _mm512_maskz_loadu_ps(mask, scale + 16 * l),
                                                            _mm512_maskz_loadu_ps(mask, y + 16 * l)));
  }
}

// y[t, j0:j1] = x[t, 0:k] · (q[0:k, j0:j1] scaled by s, a row of scales per block of `block` input rows) for t <
// rows, each block's rows in segments of at most kMostSummedRows (k and block multiples of 16): kDigitRows
// weight rows at a time streamed side by side (the next ones prefetched), 64 columns at a time, their digit sums
// kept in L1 until the segment's end; the rows read from memory for the first row of x, from L1 for the others.
LINNET_VNNI void AccumulateInt8Digits(const Digits& x, int64_t rows, const int8_t* q, const float* s, float* y,
                                      int64_t n, int64_t k, int64_t block, int64_t j0, int64_t j1) {
  constexpr int64_t kPanelInts = 4 * kDigits * 16;  // a panel's sums, as AddDigits keeps them
  const int64_t panels = (j1 - j0 + 63) / 64;
  thread_local std::vector<int32_t> kept;  // [rows, panels, kPanelInts]: a segment's sums between its passes
  kept.resize(rows * panels * kPanelInts);
  for (int64_t t = 0; t < rows; ++t) std::fill(y + t * n + j0, y + t * n + j1, 0.0f);
  for (int64_t a = 0, b; a < k; a = b) {
    b = std::min({k, (a / block + 1) * block, a + kMostSummedRows});
    for (int64_t r = a; r < b; r += kDigitRows) {
      const int64_t end = std::min(b, r + kDigitRows);
      for (int64_t j = j0; j < j1; j += 64) {
        const int64_t count = std::min<int64_t>(64, j1 - j);
        const __mmask64 columns = count == 64 ? ~__mmask64{0} : (__mmask64{1} << count) - 1;
        __m512i staged[kDigitRows / 4][4];  // the group's rows, read and interleaved once for all the rows of x
        for (int64_t i = r; i < end; i += 4) {
          for (int64_t p = 0; p < 4; ++p) PrefetchToL2(q + (i + kDigitRows + p) * n + j);  // the next group's
          Interleave(q + i * n + j, n, columns, staged[(i - r) / 4]);
        }
        for (int64_t t = 0; t < rows; ++t) {
          const int8_t* digits[kDigits];
          for (int d = 0; d < kDigits; ++d) digits[d] = x.Row(t, d);
          int32_t* panel = kept.data() + (t * panels + (j - j0) / 64) * kPanelInts;
          __m512i sums[4][kDigits] = {};
          if (r > a) std::memcpy(sums, panel, sizeof(sums));
          for (int64_t i = r; i < end; i += 4) AddDigits(staged[(i - r) / 4], digits, i, sums);
          if (end < b)
            std::memcpy(panel, sums, sizeof(sums));
          else  // the segment's last pass: its sums scaled into y (a block of at most kDigitRows: never kept)
            AddDigitPanelSums(sums, x.Sum(t, a, b), x.unit[t], s + (a / block) * n + j, y + t * n + j, count);
        }
      }
    }
  }
}

// [Σ v[0], Σ v[1], Σ v[2], Σ v[3]], each over its 16 lanes: pairs of lanes added within each 128-bit quarter, then
// the quarters.
LINNET_VNNI inline __m128i SumLanes(const __m512i (&v)[4]) {
  const __m512i v01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i v23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  const __m512i quarters = _mm512_add_epi32(_mm512_unpacklo_epi64(v01, v23), _mm512_unpackhi_epi64(v01, v23));
  const __m256i halves = _mm256_add_epi32(_mm512_castsi512_si256(quarters), _mm512_extracti64x4_epi64(quarters, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
}

// y[t, r:r+count] = (q[r:r+count, 0:k] scaled by s, s [n, k / block]) · x[t, 0:k] (count ≤ 4): each row's digit sums
// in 16 lanes over a segment (a block, or kMostSummedRows of one; block a multiple of 64 or k), added across at its
// end, the segments' scaled sums added in order.
LINNET_VNNI inline void DotDigitGroup(const int8_t* q, int64_t count, int64_t k, const float* s, int64_t block,
                                      const Digits& x, int64_t t, float* y) {
  const __m512i flip = _mm512_set1_epi8(-128);
  float totals[4] = {};
  for (int64_t a = 0, b; a < k; a = b) {
    b = std::min({k, (a / block + 1) * block, a + kMostSummedRows});
    __m512i sums[4][kDigits];
    for (auto& row : sums)
      for (auto& sum : row) sum = _mm512_setzero_si512();
    for (int64_t c = a; c < b; c += 64) {
      const __mmask64 inputs = b - c >= 64 ? ~__mmask64{0} : (__mmask64{1} << (b - c)) - 1;
      __m512i digit[kDigits];
      for (int d = 0; d < kDigits; ++d) digit[d] = _mm512_loadu_si512(x.Row(t, d) + c);
      for (int64_t i = 0; i < count; ++i) {  // masked-off weights read as 0 (u = 128), against zero digits past k
        const __m512i u = _mm512_xor_si512(_mm512_maskz_loadu_epi8(inputs, q + i * k + c), flip);
        for (int d = 0; d < kDigits; ++d) sums[i][d] = _mm512_dpbusd_epi32(sums[i][d], u, digit[d]);
      }
    }
    int32_t lanes[kDigits][4];  // each row's sums of its 16 lanes, a digit at a time
    for (int d = 0; d < kDigits; ++d) {
      const __m512i rows[4] = {sums[0][d], sums[1][d], sums[2][d], sums[3][d]};
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes[d]), SumLanes(rows));
    }
    for (int64_t i = 0; i < count; ++i) {
      int64_t total = -128 * x.Sum(t, a, b);
      for (int d = 0; d < kDigits; ++d) total += int64_t{lanes[d][i]} << (8 * d);
      const auto sum = static_cast<float>(static_cast<double>(total) * x.unit[t]);
      totals[i] = std::fma(sum, s[i * (k / block) + a / block], totals[i]);
    }
  }
  std::memcpy(y, totals, count * sizeof(float));
}

// Q8_0's blocks of 32 inputs: a 64-input chunk holds two, whose sums vpdpbusd leaves in lanes 0-7 and 8-15.
constexpr int64_t kPairBlock = 32;

// Whether a head's scales come in kPairBlock blocks that DotDigitPairGroup takes (k a multiple of 64).
inline bool InPairs(int64_t block, int64_t k) { return block == kPairBlock && block != k && k % 64 == 0; }

// What each lane of a chunk's digit sums holds beyond Σ q X (u = q + 128): 128 times the lane's four digits, for
// every row of x and 64-input chunk (k a multiple of 64) two vectors of 16 lanes, [rows, k / 64, 2, 16]: the low
// digits' (d0 + 256 d1) and the high one's (d2). The calling thread's, read by the parts it hands out before it
// returns.
LINNET_VNNI const std::vector<int32_t>& DigitOffsets(const Digits& x, int64_t rows, int64_t k) {
  const __m512i half = _mm512_set1_epi8(-128), zero = _mm512_setzero_si512();  // 128 as unsigned bytes
  thread_local std::vector<int32_t> offsets;
  offsets.resize(rows * (k / 64) * 32);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < k; c += 64) {
      __m512i sums[kDigits];
      for (int d = 0; d < kDigits; ++d) sums[d] = _mm512_dpbusd_epi32(zero, half, _mm512_loadu_si512(x.Row(t, d) + c));
      int32_t* out = offsets.data() + (t * (k / 64) + c / 64) * 32;
      _mm512_storeu_si512(out, _mm512_add_epi32(sums[0], _mm512_slli_epi32(sums[1], 8)));
      _mm512_storeu_si512(out + 16, sums[2]);
    }
  return offsets;
}

// DotDigitGroup for blocks of kPairBlock (k a multiple of 64): each chunk's digit sums, less their offsets, are exact
// 32-bit lanes (|low| < 2^25, |high| < 2^16), made one float lane (the high one times 2^16 exactly, one rounding),
// scaled by its block's scale and added in the row's 16 float lanes, summed at the row's end: the float rounding
// of a float32 dot product, in one order whatever the rows or threads.
LINNET_VNNI inline void DotDigitPairGroup(const int8_t* q, int64_t count, int64_t k, const float* s, const Digits& x,
                                          int64_t t, const int32_t* offsets, float* y) {
  const __m512i flip = _mm512_set1_epi8(-128), zero = _mm512_setzero_si512();
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);  // lane -> its block
  const int64_t blocks = k / kPairBlock;
  __m512 totals[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t c = 0; c < k; c += 64) {
    __m512i digit[kDigits];
    for (int d = 0; d < kDigits; ++d) digit[d] = _mm512_loadu_si512(x.Row(t, d) + c);
    const __m512i low_offset = _mm512_loadu_si512(offsets + c / 2), high_offset = _mm512_loadu_si512(offsets + c / 2 + 16);
    for (int64_t i = 0; i < count; ++i) {
      const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(q + i * k + c), flip);
      __m512i sums[kDigits];
      for (int d = 0; d < kDigits; ++d) sums[d] = _mm512_dpbusd_epi32(zero, u, digit[d]);
      const __m512i low = _mm512_sub_epi32(_mm512_add_epi32(sums[0], _mm512_slli_epi32(sums[1], 8)), low_offset);
      const __m512i high = _mm512_sub_epi32(sums[2], high_offset);
      const __m512 lanes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), _mm512_set1_ps(65536.0f), _mm512_cvtepi32_ps(low));
      double scales;  // the chunk's two blocks' scales, side by side
      std::memcpy(&scales, s + i * blocks + c / kPairBlock, sizeof(scales));
      totals[i] = _mm512_fmadd_ps(lanes, _mm512_permutexvar_ps(pair, _mm512_castpd_ps(_mm512_set1_pd(scales))), totals[i]);
    }
  }
  for (int64_t i = 0; i < count; ++i)
    y[i] = static_cast<float>(static_cast<double>(_mm512_reduce_add_ps(totals[i])) * x.unit[t]);
}

// y[t, r] = (q[r, 0:k] scaled, s [n, k / block]) · x[t, 0:k] for r in r0..r1 and t < rows (y [rows, n]): four rows
// of q at a time, read from memory for the first row of x (the group kGroupsAhead on prefetched) and from the caches
// for the others. Blocks of kPairBlock go through DotDigitPairGroup, with x's DigitOffsets (else null).
LINNET_VNNI void DotInt8Digits(const Digits& x, const int32_t* offsets, int64_t rows, const int8_t* q, const float* s,
                               float* y, int64_t n, int64_t k, int64_t block, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; r += 4) {
    if (r + 4 * (kGroupsAhead + 1) <= r1)
      for (int64_t p = 0; p < 4 * k; p += 64) PrefetchToL2(q + (r + 4 * kGroupsAhead) * k + p);
    const int64_t count = std::min<int64_t>(4, r1 - r);
    for (int64_t t = 0; t < rows; ++t) {
      if (offsets)
        DotDigitPairGroup(q + r * k, count, k, s + r * (k / block), x, t, offsets + t * (k / 64) * 32, y + t * n + r);
      else
        DotDigitGroup(q + r * k, count, k, s + r * (k / block), block, x, t, y + t * n + r);
    }
  }
}
#endif

// Runs part(i) for i in 0..parts-1 and returns when all are done. This thread and a pool task per pool thread (at
// most parts-1) each claim the next unclaimed part until none is left, so this thread only ever waits for parts
// that another thread is running: when the pool is busy (or runs several products at once) it does them all itself.
struct Progress {
  std::atomic<int64_t> next{0}, done{0};
};

template <typename Part>
void RunParts(ffi::ThreadPool& pool, int64_t parts, const Part& part) {
  auto progress = std::make_shared<Progress>();  // shared: a task may start after this call returned
  auto work = [progress, parts, part] {
    for (int64_t i; (i = progress->next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      part(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(parts - 1, pool.num_threads());
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (progress->done.load(std::memory_order_acquire) < parts) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

// How many parts to split `rows` into: one per pool thread, at least kMinRowsPerPart rows each.
int64_t Parts(ffi::ThreadPool& pool, int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), rows / kMinRowsPerPart));
}

// dot(r0, r1) for the n output rows, split across the threads.
template <typename RowsPart>
void SplitOutputs(ffi::ThreadPool& pool, int64_t n, const RowsPart& dot) {
  const int64_t parts = Parts(pool, n);
  const int64_t step = ((n + parts - 1) / parts + 3) / 4 * 4;  // whole groups of four: a row's sums never depend on n
  RunParts(pool, parts, [&](int64_t i) { dot(i * step, std::min(n, (i + 1) * step)); });
}

// One int8 product of a step's activations x [rows, k]: y [rows, n] = x · (q [k, n] scaled by s [k / block, n]).
struct Int8Product {
  const int8_t* q;
  const float* s;
  float* y;
  int64_t n, block;
};

#ifdef LINNET_AVX2
constexpr int64_t kMinPartBytes = 128 << 10;  // a smaller part of a product costs about as much to hand over as to run

// The products of one x by digits, their panels of 64 columns split across the threads together (a part may span
// products; a column's sums do not depend on the parts), at least kMinPartBytes of the weights a part.
void DigitProducts(ffi::ThreadPool& pool, const Digits& x, int64_t rows, int64_t k,
                   const std::vector<Int8Product>& products) {
  std::vector<int64_t> first = {0};  // each product's first panel among all of them
  int64_t bytes = 0;
  for (const Int8Product& product : products) {
    first.push_back(first.back() + (product.n + 63) / 64);
    bytes += k * product.n;
  }
  const int64_t panels = first.back();
  const int64_t parts = std::clamp<int64_t>(bytes / kMinPartBytes, 1, std::min<int64_t>(pool.num_threads(), panels));
  const int64_t step = (panels + parts - 1) / parts;
  RunParts(pool, parts, [&](int64_t part) {
    for (size_t i = 0; i < products.size(); ++i) {
      const Int8Product& product = products[i];
      const int64_t p0 = std::max(part * step, first[i]), p1 = std::min((part + 1) * step, first[i + 1]);
      if (p0 < p1)
        AccumulateInt8Digits(x, rows, product.q, product.s, product.y, product.n, k, product.block,
                             (p0 - first[i]) * 64, std::min(product.n, (p1 - first[i]) * 64));
    }
  });
}
#endif

// For each product p of one input (outs[p]: its n outputs), out = the sum over the k input rows of
// accumulate(p, partial, r0, r1): the rows cut into up to kInputParts parts (whole groups of kBatchWeightRows) by k
// alone, each accumulated into its own partial by whichever thread claims it (part 0 into out), every product's parts
// handed to the threads together, the partials then added in order (each thread a range of all the outputs). So a
// product's sums depend neither on how many threads the pool has (a one-core Ray replica gives what a two-core
// process gives) nor on the other products.
constexpr int64_t kInputParts = 8;

struct Outputs {
  int64_t n;
  float* out;
};

template <typename Accumulate>
void SplitInputs(ffi::ThreadPool& pool, int64_t k, const std::vector<Outputs>& outs, const Accumulate& accumulate) {
  const int64_t most = std::max<int64_t>(1, std::min(kInputParts, k / kMinRowsPerPart));
  const int64_t step = ((k + most - 1) / most + kBatchWeightRows - 1) / kBatchWeightRows * kBatchWeightRows;
  const int64_t parts = (k + step - 1) / step, products = outs.size();
  std::vector<int64_t> first = {0};  // each product's first output among all of them
  for (const Outputs& product : outs) first.push_back(first.back() + product.n);
  thread_local std::vector<float> scratch;  // the caller's: parts 1.. accumulate here, then into out
  scratch.resize((parts - 1) * first.back());
  float* partials = scratch.data();  // (the other threads' `scratch` is their own)
  const auto partial = [&](int64_t p, int64_t i) { return partials + (parts - 1) * first[p] + (i - 1) * outs[p].n; };
  RunParts(pool, parts * products, [&](int64_t unit) {
    const int64_t p = unit / parts, i = unit % parts;
    accumulate(p, i == 0 ? outs[p].out : partial(p, i), i * step, std::min(k, (i + 1) * step));
  });
  if (parts == 1) return;
  SplitOutputs(pool, first.back(), [&](int64_t j0, int64_t j1) {  // each thread adds the partials into its outputs
    for (int64_t p = 0; p < products; ++p) {
      const int64_t a = std::max(j0, first[p]) - first[p], b = std::min(j1, first[p + 1]) - first[p];
      for (int64_t i = 1; i < parts; ++i)
        for (int64_t j = a; j < b; ++j) outs[p].out[j] += partial(p, i)[j];
    }
  });
}

// The float32 products of one x [T, K] with several weights (a layer's q, k and v, or its gate and up) in one call:
// args x, then each w [K, N]; results each y [T, N]. The batch loops read each weight once for all the rows and sum
// each row in the same order whatever T is (a request's tokens do not depend on its batch) or the other products.
ffi::Error Xw(ffi::ThreadPool pool, Matrix x, ffi::RemainingArgs weights, ffi::RemainingRets results) {
  const int64_t rows = x.dimensions()[0], k = x.dimensions()[1];
  if (weights.size() != results.size()) return ffi::Error::InvalidArgument("linnet_xw takes x, then a weight per result");
  std::vector<const float*> ws;
  std::vector<Outputs> outs;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto w = weights.get<Matrix>(i);
    auto y = results.get<Matrix>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("linnet_xw: float32 [K, N] weights");
    ws.push_back(w->typed_data());
    outs.push_back({rows * w->dimensions()[1], (*y)->typed_data()});
  }
  SplitInputs(pool, k, outs, [&](int64_t p, float* out, int64_t r0, int64_t r1) {
    AccumulateBatch(x.typed_data(), k, rows, ws[p], out, outs[p].n / rows, r0, r1);
  });
  return ffi::Error::Success();
}

ffi::Error Wx(ffi::ThreadPool pool, Matrix x, Matrix w, MatrixResult y) {
  const int64_t rows = x.dimensions()[0], n = w.dimensions()[0], k = w.dimensions()[1];
  SplitOutputs(pool, n, [&](int64_t r0, int64_t r1) {
    DotRowGroups(x.typed_data(), rows, w.typed_data(), k, k, y->typed_data(), n, r0, r1);
  });
  return ffi::Error::Success();
}

// The int8 products of one x [T, K] with several weights (a layer's q, k and v, or its gate and up) in one call:
// args x, then each weight's q [K, N] and s [K / G, N]; results each y [T, N]. By digits where the CPU has VNNI
// (x's digits made once, every product's columns split across the threads together), else each product through the
// widened loops; a product's result is the same alone or among others.
ffi::Error XwInt8(ffi::ThreadPool pool, Matrix x, ffi::RemainingArgs weights, ffi::RemainingRets outputs,
                  bool digits) {
  const int64_t rows = x.dimensions()[0], k = x.dimensions()[1];
  if (weights.size() != 2 * outputs.size())
    return ffi::Error::InvalidArgument("linnet_xw_int8 takes x, then an int8 weight and its scales per result");
  std::vector<Int8Product> products;
  bool by_digits = digits && k % 16 == 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto q = weights.get<Int8Matrix>(2 * i);
    const auto s = weights.get<Matrix>(2 * i + 1);
    auto y = outputs.get<Matrix>(i);
    if (!q.has_value() || !s.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("linnet_xw_int8: a weight must be int8 [K, N], its scales and result float32");
    const int64_t n = q->dimensions()[1], block = k / s->dimensions()[0];
    by_digits = by_digits && block % 16 == 0;
    products.push_back({q->typed_data(), s->typed_data(), (*y)->typed_data(), n, block});
  }
#ifdef LINNET_AVX2
  if (by_digits && HasVnni()) {
    DigitProducts(pool, ToDigits(x.typed_data(), rows, k), rows, k, products);
    return ffi::Error::Success();
  }
#endif
  std::vector<Outputs> outs;
  for (const Int8Product& product : products) outs.push_back({rows * product.n, product.y});
  SplitInputs(pool, k, outs, [&](int64_t p, float* out, int64_t r0, int64_t r1) {
    const Int8Product& product = products[p];
    AccumulateInt8(x.typed_data(), k, rows, product.q, product.s, out, product.n, product.block, r0, r1);
  });
  return ffi::Error::Success();
}

ffi::Error WxInt8(ffi::ThreadPool pool, Matrix x, Int8Matrix q, Matrix s, MatrixResult y, bool digits) {
  const int64_t rows = x.dimensions()[0], n = q.dimensions()[0], k = q.dimensions()[1], block = k / s.dimensions()[1];
#ifdef LINNET_AVX2
  if (digits && HasVnni() && k % 16 == 0 && (block % 64 == 0 || block == k || InPairs(block, k))) {
    const Digits& xd = ToDigits(x.typed_data(), rows, k);
    const int32_t* offsets = InPairs(block, k) ? DigitOffsets(xd, rows, k).data() : nullptr;
    SplitOutputs(pool, n, [&](int64_t r0, int64_t r1) {
      DotInt8Digits(xd, offsets, rows, q.typed_data(), s.typed_data(), y->typed_data(), n, k, block, r0, r1);
    });
    return ffi::Error::Success();
  }
#endif
  SplitOutputs(pool, n, [&](int64_t r0, int64_t r1) {
    DotInt8Rows(x.typed_data(), rows, q.typed_data(), s.typed_data(), y->typed_data(), n, k, block, r0, r1);
  });
  return ffi::Error::Success();
}

// Batched a · bᵀ over each n's first slots[n] key slots: b's rows (slots_contracted false: the scores, 0 past them)
// or the contracted axis (true: the mixing, whose probabilities are 0 past them). The N·J rows of b split across the
// threads (a part may span several n), so one n of many rows (batch-1 attention) splits as well as many n of a few.
ffi::Error Abt(ffi::ThreadPool pool, Cube a, Cube b, Int32Vector slots, CubeResult y,
               bool slots_contracted) {
  const int64_t rows = a.dimensions()[1], j = b.dimensions()[1], c = b.dimensions()[2];
  const float *as = a.typed_data(), *bs = b.typed_data();
  const int32_t* counts = slots.typed_data();
  float* ys = y->typed_data();
  SplitOutputs(pool, a.dimensions()[0] * j, [&](int64_t r0, int64_t r1) {  // b may have more rows: unread
    for (int64_t r = r0; r < r1;) {
      const int64_t n = r / j, end = std::min(r1, (n + 1) * j), j0 = r - n * j, j1 = end - n * j;
      const int64_t count = std::clamp<int64_t>(counts[n], 0, slots_contracted ? c : j);
      const int64_t stop = slots_contracted ? j1 : std::clamp(count, j0, j1);
      float* yn = ys + n * rows * j;
      DotRowGroups(as + n * rows * c, rows, bs + n * j * c, c, slots_contracted ? count : c, yn, j, j0, stop);
      for (int64_t i = 0; i < rows; ++i) std::fill(yn + i * j + stop, yn + i * j + j1, 0.0f);
      r = end;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinnetXw, Xw,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Matrix>().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinnetWx, Wx,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Matrix>().Arg<Matrix>().Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    LinnetXwInt8, XwInt8,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Matrix>().RemainingArgs().RemainingRets().Attr<bool>("digits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    LinnetWxInt8, WxInt8,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Matrix>().Arg<Int8Matrix>().Arg<Matrix>().Ret<Matrix>().Attr<bool>("digits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinnetAbt, Abt,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Cube>()
                                  .Arg<Cube>()
                                  .Arg<Int32Vector>()
                                  .Ret<Cube>()
                                  .Attr<bool>("slots_contracted"));

// The jaxlib whose XLA FFI headers these handlers were compiled against (setup.py defines it): ops/matvec.py
// registers them only on that jaxlib or a newer one, as an older XLA refuses a newer handler API.
extern "C" const char* LinnetJaxlibVersion() { return LINNET_JAXLIB_VERSION; }
