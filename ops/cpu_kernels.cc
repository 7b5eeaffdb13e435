// Matrix-vector products for batch-1 decode on XLA:CPU, as XLA FFI handlers (ops/matvec.py registers them).
//
// XLA:CPU runs a product under ~2 MB on one core, and the larger ones below the bandwidth two cores reach
// (benchmarks/RESULTS.md). These split every product's weight rows across the calling thread and XLA's
// intra-op pool, each thread streaming its own contiguous rows, as llama.cpp splits a product across its
// threads. Float32 only; the compiler vectorizes the loops (AVX2 + FMA on x86-64, see setup.py).
//
//   linnet_xw: y[N] = x[K] · w[K, N]   (projections stored input-first)
//   linnet_wx: y[N] = w[N, K] · x[K]   (the lm head, stored [vocab, embed])

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Vector = ffi::Buffer<ffi::F32, 1>;
using Matrix = ffi::Buffer<ffi::F32, 2>;
using VectorResult = ffi::ResultBuffer<ffi::F32, 1>;

constexpr int64_t kMinRowsPerPart = 64;  // below this a part costs more to hand over than to run

// y[0:n] = x[r0:r1] · w[r0:r1, 0:n]: four weight rows per pass over y.
void AccumulateRows(const float* x, const float* w, float* y, int64_t n, int64_t r0, int64_t r1) {
  std::memset(y, 0, n * sizeof(float));
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const float *w0 = w + r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    const float x0 = x[r], x1 = x[r + 1], x2 = x[r + 2], x3 = x[r + 3];
    for (int64_t j = 0; j < n; ++j) y[j] += x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j];
  }
  for (; r < r1; ++r) {
    const float* w0 = w + r * n;
    for (int64_t j = 0; j < n; ++j) y[j] += x[r] * w0[j];
  }
}

// y[r] = w[r, 0:k] · x for r in r0..r1, eight partial sums per row.
void DotRows(const float* x, const float* w, float* y, int64_t k, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w + r * k;
    float sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= k; j += 8)
      for (int l = 0; l < 8; ++l) sums[l] += row[j + l] * x[j + l];
    float total = 0;
    for (; j < k; ++j) total += row[j] * x[j];
    for (float s : sums) total += s;
    y[r] = total;
  }
}

// Runs part(i) for i in 0..parts-1 and returns when all are done. This thread and parts-1 pool tasks each
// claim the next unclaimed part until none is left, so this thread only ever waits for parts that another
// thread is running: when the pool is busy (or runs several products at once) it does them all itself.
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
  for (int64_t i = 1; i < parts; ++i) {
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

ffi::Error Xw(ffi::ThreadPool pool, Vector x, Matrix w, VectorResult y) {
  const int64_t k = w.dimensions()[0], n = w.dimensions()[1];
  const int64_t parts = Parts(pool, k);
  const int64_t step = (k + parts - 1) / parts;
  thread_local std::vector<float> scratch;  // the caller's: parts 1.. accumulate here, then into y
  scratch.resize((parts - 1) * n);
  float *out = y->typed_data(), *partials = scratch.data();
  RunParts(pool, parts, [&](int64_t i) {  // part 0 into y, part i > 0 into partials
    AccumulateRows(x.typed_data(), w.typed_data(), i == 0 ? out : partials + (i - 1) * n, n, i * step,
                   std::min(k, (i + 1) * step));
  });
  for (int64_t i = 1; i < parts; ++i) {
    const float* partial = partials + (i - 1) * n;
    for (int64_t j = 0; j < n; ++j) out[j] += partial[j];
  }
  return ffi::Error::Success();
}

ffi::Error Wx(ffi::ThreadPool pool, Vector x, Matrix w, VectorResult y) {
  const int64_t n = w.dimensions()[0], k = w.dimensions()[1];
  const int64_t parts = Parts(pool, n);
  const int64_t step = (n + parts - 1) / parts;
  RunParts(pool, parts, [&](int64_t i) {
    DotRows(x.typed_data(), w.typed_data(), y->typed_data(), k, i * step, std::min(n, (i + 1) * step));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinnetXw, Xw,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Vector>().Arg<Matrix>().Ret<Vector>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinnetWx, Wx,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Vector>().Arg<Matrix>().Ret<Vector>());

// The jaxlib whose XLA FFI headers these handlers were compiled against (setup.py defines it): ops/matvec.py
// registers them only on that jaxlib or a newer one, as an older XLA refuses a newer handler API.
extern "C" const char* LinnetJaxlibVersion() { return LINNET_JAXLIB_VERSION; }
