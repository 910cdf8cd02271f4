// Few-row weight products for XLA:CPU, as XLA FFI custom calls:
//   y[M, N] = x[M, K] . W[N, K]^T        (W output-major, as jspec's packed layout holds it)
// with W in float32, bfloat16, or int8 with float32 scales (one per output row, or one per
// `block` inputs of a row: GGUF Q8_0 / Q4_0 and jspec's tiled int8).
//
// Why: for 2-64 rows XLA:CPU hands the product to Eigen's GEMM, which streams the weight at
// about half the DRAM bandwidth its own one-row loop reaches, and it converts a bf16 or int8
// weight to a float32 copy before any dot. Here every weight row is read from memory once,
// converted in registers, and multiplied by all M input rows while it sits in L1, so a
// verify of a few rows costs about what a one-row step costs, and a weight stored in fewer
// bytes is read in fewer bytes.
//
// Every output y[m, n] is computed by the same instruction sequence whatever M is and
// wherever row m sits in the block: 16-lane partial sums over k in order, the block scale
// (if any) applied per block in order, then one fixed horizontal sum. So a verify row's
// product is bit-identical to its 1-token step's (exactness by construction).
//
// W8A8 (jspec_rows_i8i8): int8 activations (one scale per row) times int8 weights (one scale
// per output row), summed exactly in int32 by AVX-512 VNNI dot products (4x the multiply
// rate of float FMAs), then scaled as XLA's program scales them, (float(sum) * x_scale) *
// w_scale: the same bits as the XLA product it replaces.
//
// Needs AVX-512 F/BW/VL (+ VNNI for W8A8), checked at run time by the Python side through
// jspec_rows_supported() / jspec_rows_vnni_supported(); the module is compiled with those
// target attributes only on the kernels, so loading it on an older CPU is safe.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define JSPEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define JSPEC_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,fma,avx512vnni")))

namespace {

enum class WKind { kF32, kBF16, kI8, kI8I8 };

// One product's operands. x: float32 [M, K] (int8 for kI8I8); w: [N, K] in the kind's dtype;
// scale: the weight's scales ([N, 1], or [N, K / block] with block > 0); xscale, xsum: kI8I8's
// activation scales [M] and each activation row's sum (for the unsigned-offset correction).
struct Args {
  const void* x = nullptr;
  const void* w = nullptr;
  const float* scale = nullptr;
  const float* xscale = nullptr;
  const int32_t* xsum = nullptr;
  float* y = nullptr;
  int64_t M = 0, K = 0, N = 0, block = 0;
};

template <WKind kind>
constexpr int64_t elem_bytes() {
  return kind == WKind::kF32 ? 4 : kind == WKind::kBF16 ? 2 : 1;
}

#ifndef JSPEC_PREFETCH
#define JSPEC_PREFETCH 32768
#endif
// How far ahead of the row being read the next weight bytes are prefetched: measured on the
// LM head (49152 x 576), 8 rows, 2 threads: fp32 25.2 ms without, 14.5 ms at 32 KiB.
constexpr int64_t kPrefetchBytes = JSPEC_PREFETCH;

// 16 weights of row `w` at column k as float32 lanes (`mask` selects the valid ones).
template <WKind kind>
JSPEC_AVX512 inline __m512 load_w(const void* w, int64_t k, __mmask16 mask) {
  if constexpr (kind == WKind::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(w) + k);
  } else if constexpr (kind == WKind::kBF16) {
    __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(w) + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    __m128i b = _mm_maskz_loadu_epi8(mask, static_cast<const int8_t*>(w) + k);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
}

template <int RN>
JSPEC_AVX512 inline void prefetch_rows(const void* const* wr, int64_t byte) {
  for (int r = 0; r < RN; ++r)
    _mm_prefetch(static_cast<const char*>(wr[r]) + byte + kPrefetchBytes, _MM_HINT_T0);
}

// Float weights: RN weight rows [n0, n0 + RN) times RM input rows [m0, m0 + RM). `block` > 0:
// `scale` holds K / block scales per weight row, each multiplying its block's partial sum;
// block == 0 and scale != null: one scale per weight row, applied to the finished sum.
template <WKind kind, int RN, int RM>
JSPEC_AVX512 void tile_float(const Args& a, int64_t n0, int64_t m0) {
  const int64_t K = a.K, block = a.block;
  const float* scale = a.scale;
  const void* wr[RN];
  for (int r = 0; r < RN; ++r)
    wr[r] = static_cast<const char*>(a.w) + (n0 + r) * K * elem_bytes<kind>();
  const float* xr[RM];
  for (int i = 0; i < RM; ++i) xr[i] = static_cast<const float*>(a.x) + (m0 + i) * K;
  __m512 acc[RN][RM];
  for (int r = 0; r < RN; ++r)
    for (int i = 0; i < RM; ++i) acc[r][i] = _mm512_setzero_ps();

  if (block > 0) {
    const int64_t nb = K / block;
    for (int64_t b = 0; b < nb; ++b) {
      __m512 part[RN][RM];
      for (int r = 0; r < RN; ++r)
        for (int i = 0; i < RM; ++i) part[r][i] = _mm512_setzero_ps();
      for (int64_t k = b * block; k < (b + 1) * block; k += 16) {
        __m512 wv[RN];
        for (int r = 0; r < RN; ++r) wv[r] = load_w<kind>(wr[r], k, 0xFFFF);
        if (m0 == 0 && (k * elem_bytes<kind>()) % 64 == 0)
          prefetch_rows<RN>(wr, k * elem_bytes<kind>());
        for (int i = 0; i < RM; ++i) {
          __m512 xv = _mm512_loadu_ps(xr[i] + k);
          for (int r = 0; r < RN; ++r) part[r][i] = _mm512_fmadd_ps(xv, wv[r], part[r][i]);
        }
      }
      for (int r = 0; r < RN; ++r) {
        __m512 s = _mm512_set1_ps(scale[(n0 + r) * nb + b]);
        for (int i = 0; i < RM; ++i) acc[r][i] = _mm512_fmadd_ps(part[r][i], s, acc[r][i]);
      }
    }
  } else {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      __m512 wv[RN];
      for (int r = 0; r < RN; ++r) wv[r] = load_w<kind>(wr[r], k, 0xFFFF);
      if (m0 == 0 && (k * elem_bytes<kind>()) % 64 == 0)
        prefetch_rows<RN>(wr, k * elem_bytes<kind>());
      for (int i = 0; i < RM; ++i) {
        __m512 xv = _mm512_loadu_ps(xr[i] + k);
        for (int r = 0; r < RN; ++r) acc[r][i] = _mm512_fmadd_ps(xv, wv[r], acc[r][i]);
      }
    }
    if (k < K) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
      __m512 wv[RN];
      for (int r = 0; r < RN; ++r) wv[r] = load_w<kind>(wr[r], k, mask);
      for (int i = 0; i < RM; ++i) {
        __m512 xv = _mm512_maskz_loadu_ps(mask, xr[i] + k);
        for (int r = 0; r < RN; ++r) acc[r][i] = _mm512_fmadd_ps(xv, wv[r], acc[r][i]);
      }
    }
  }
  const bool per_row = block == 0 && scale != nullptr;
  for (int r = 0; r < RN; ++r) {
    const float s = per_row ? scale[n0 + r] : 1.0f;
    for (int i = 0; i < RM; ++i) {
      const float v = _mm512_reduce_add_ps(acc[r][i]);
      a.y[(m0 + i) * a.N + n0 + r] = per_row ? v * s : v;
    }
  }
}

// W8A8: 64 int8 products a VNNI instruction, exact in int32. vpdpbusd multiplies unsigned by
// signed bytes, so the weight is read offset by 128 (w ^ 0x80 is w + 128 as an unsigned byte)
// and 128 * sum(x) is taken off: sum((w + 128) x) - 128 sum(x) = sum(w x), exactly.
template <int RN, int RM>
JSPEC_AVX512_VNNI void tile_i8i8(const Args& a, int64_t n0, int64_t m0) {
  const int64_t K = a.K;
  const int8_t* wr[RN];
  for (int r = 0; r < RN; ++r) wr[r] = static_cast<const int8_t*>(a.w) + (n0 + r) * K;
  const int8_t* xr[RM];
  for (int i = 0; i < RM; ++i) xr[i] = static_cast<const int8_t*>(a.x) + (m0 + i) * K;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[RN][RM];
  for (int r = 0; r < RN; ++r)
    for (int i = 0; i < RM; ++i) acc[r][i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~0ULL : (1ULL << (K - k)) - 1ULL;
    __m512i wv[RN];
    // A masked-off weight byte reads 0 and becomes 128; its activation byte reads 0.
    for (int r = 0; r < RN; ++r)
      wv[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, wr[r] + k), offset);
    if (m0 == 0) prefetch_rows<RN>(reinterpret_cast<const void* const*>(wr), k);
    for (int i = 0; i < RM; ++i) {
      const __m512i xv = _mm512_maskz_loadu_epi8(mask, xr[i] + k);
      for (int r = 0; r < RN; ++r) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], wv[r], xv);
    }
  }
  for (int r = 0; r < RN; ++r) {
    const float ws = a.scale[n0 + r];
    for (int i = 0; i < RM; ++i) {
      const int32_t sum = _mm512_reduce_add_epi32(acc[r][i]) - 128 * a.xsum[m0 + i];
      a.y[(m0 + i) * a.N + n0 + r] = (static_cast<float>(sum) * a.xscale[m0 + i]) * ws;
    }
  }
}

template <WKind kind, int RN, int RM>
inline void tile(const Args& a, int64_t n0, int64_t m0) {
  if constexpr (kind == WKind::kI8I8) tile_i8i8<RN, RM>(a, n0, m0);
  else tile_float<kind, RN, RM>(a, n0, m0);
}

// Input rows [m0, m0 + RM) times weight rows [n0, n0 + 8): RN weight rows a tile, RN chosen
// so that a tile keeps 8-16 independent accumulators (a one-row step needs 8 weight rows in
// flight to hide the FMA latency; 8 input rows need only 2). The arithmetic of an output does
// not depend on RN.
template <WKind kind, int RM>
inline void group(const Args& a, int64_t n0, int64_t m0) {
  constexpr int RN = RM == 1 ? 8 : RM == 2 ? 8 : RM <= 4 ? 4 : 2;
  for (int r = 0; r < 8; r += RN) tile<kind, RN, RM>(a, n0 + r, m0);
}

// All M rows times weight rows [lo, hi): 8 weight rows at a time (read from memory once, then
// from L1/L2 for every further block of input rows), input rows in blocks of 8 and a last
// block of 1-7; the 0-7 weight rows left over one at a time.
template <WKind kind>
void rows_range(const Args& a, int64_t lo, int64_t hi) {
  const int64_t M = a.M;
  int64_t n = lo;
  for (; n + 8 <= hi; n += 8) {
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) group<kind, 8>(a, n, m0);
    switch (M - m0) {
      case 1: group<kind, 1>(a, n, m0); break;
      case 2: group<kind, 2>(a, n, m0); break;
      case 3: group<kind, 3>(a, n, m0); break;
      case 4: group<kind, 4>(a, n, m0); break;
      case 5: group<kind, 5>(a, n, m0); break;
      case 6: group<kind, 6>(a, n, m0); break;
      case 7: group<kind, 7>(a, n, m0); break;
      default: break;
    }
  }
  for (; n < hi; ++n)
    for (int64_t m = 0; m < M; ++m) tile<kind, 1, 1>(a, n, m);
}

// Splits the weight rows into chunks that XLA's intra-op pool and the calling thread take
// from one counter. The caller takes chunks too, so every chunk runs even if the pool is busy
// or absent; a pool task that starts after the last chunk was taken returns at once, and the
// caller waits only for the chunks that were taken.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks = 0;
  int64_t chunk_rows = 0;
  void (*fn)(const Args&, int64_t lo, int64_t hi) = nullptr;
  Args args;

  void drain() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      const int64_t lo = c * chunk_rows;
      fn(args, lo, std::min(args.N, lo + chunk_rows));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <WKind kind>
ffi::Error product(ffi::ThreadPool pool, const Args& args) {
  if (args.M == 0 || args.N == 0) return ffi::Error::Success();
  auto wk = std::make_shared<Work>();
  wk->fn = &rows_range<kind>;
  wk->args = args;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // About 64 KiB of weights a chunk at least, 4 chunks a thread at most (an even split
  // whatever a thread's share of the memory bus turns out to be). Chunks hold a multiple of 8
  // rows, the kernel's group.
  const int64_t row_bytes = args.K * elem_bytes<kind>();
  int64_t rows = std::max<int64_t>(2, (65536 + row_bytes - 1) / row_bytes);
  rows = std::max(rows, (args.N + 4 * threads - 1) / (4 * threads));
  rows = (rows + 7) / 8 * 8;
  wk->chunk_rows = rows;
  wk->chunks = (args.N + rows - 1) / rows;
  threads = std::min(threads, wk->chunks);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([wk] { wk->drain(); });
  wk->drain();
  while (wk->done.load(std::memory_order_acquire) < wk->chunks) _mm_pause();
  return ffi::Error::Success();
}

ffi::Error check(int64_t M, int64_t K, int64_t N, ffi::Span<const int64_t> xd,
                 ffi::Span<const int64_t> wd, ffi::Span<const int64_t> yd) {
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || wd[1] != K || yd[0] != M ||
      yd[1] != N)
    return ffi::Error::InvalidArgument("jspec_rows: expected x[M, K], w[N, K], y[M, N]");
  return ffi::Error::Success();
}

template <WKind kind, typename X, typename W>
ffi::Error float_rows(ffi::ThreadPool pool, X x, W w, const float* scale, int64_t block,
                      ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  Args a;
  a.M = xd[0]; a.K = xd[1]; a.N = wd[0]; a.block = block;
  if (auto e = check(a.M, a.K, a.N, xd, wd, y->dimensions()); e.failure()) return e;
  a.x = x.untyped_data(); a.w = w.untyped_data(); a.scale = scale; a.y = y->typed_data();
  return product<kind>(pool, a);
}

ffi::Error RowsF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  return float_rows<WKind::kF32>(pool, x, w, nullptr, 0, y);
}

ffi::Error RowsBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return float_rows<WKind::kBF16>(pool, x, w, nullptr, 0, y);
}

// scale [N, 1]: one per output row; scale [N, K / block] with block % 16 == 0: per block.
ffi::Error RowsI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                  ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto sd = scale.dimensions();
  const int64_t K = x.dimensions()[1], N = w.dimensions()[0];
  if (sd.size() != 2 || sd[0] != N || sd[1] < 1 || K % sd[1] != 0)
    return ffi::Error::InvalidArgument("jspec_rows_i8: expected scale[N, 1] or [N, K / block]");
  const int64_t block = sd[1] == 1 ? 0 : K / sd[1];
  if (block % 16 != 0)
    return ffi::Error::InvalidArgument(
        "jspec_rows_i8: a scale block must hold a multiple of 16 inputs");
  return float_rows<WKind::kI8>(pool, x, w, scale.typed_data(), block, y);
}

// W8A8, per output channel: xq [M, K] int8 with xscale [M, 1], w [N, K] int8 with scale [N, 1].
ffi::Error RowsI8I8(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::F32> xscale,
                    ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  Args a;
  a.M = xd[0]; a.K = xd[1]; a.N = wd[0];
  if (auto e = check(a.M, a.K, a.N, xd, wd, y->dimensions()); e.failure()) return e;
  if (xscale.element_count() != a.M || scale.element_count() != a.N)
    return ffi::Error::InvalidArgument("jspec_rows_i8i8: expected xscale[M, 1] and scale[N, 1]");
  const int8_t* xq = x.typed_data();
  std::unique_ptr<int32_t[]> xsum(new int32_t[a.M]);
  for (int64_t m = 0; m < a.M; ++m) {
    int32_t s = 0;
    for (int64_t k = 0; k < a.K; ++k) s += xq[m * a.K + k];
    xsum[m] = s;
  }
  a.x = xq; a.w = w.untyped_data(); a.scale = scale.typed_data();
  a.xscale = xscale.typed_data(); a.xsum = xsum.get(); a.y = y->typed_data();
  return product<WKind::kI8I8>(pool, a);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jspec_rows_f32, RowsF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jspec_rows_bf16, RowsBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jspec_rows_i8, RowsI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jspec_rows_i8i8, RowsI8I8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether this CPU runs the kernels (the Python side registers them only then).
extern "C" int jspec_rows_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
}

// Whether it also runs the W8A8 kernel (AVX-512 VNNI).
extern "C" int jspec_rows_vnni_supported() {
  return jspec_rows_supported() && __builtin_cpu_supports("avx512vnni");
}
