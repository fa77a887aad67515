// Paged attention for XLA:CPU, called from jitted JAX code as an FFI custom call.
//
// The contract is kernels/reference.py's: over a ragged batch, the new tokens of
// sequence s (rows query_start_loc[s] .. query_start_loc[s + 1] - 1) are its last
// positions, and each attends causally (and within the sliding window) to the keys of
// its sequence, read in place through its block table: no gathered copy of K or V,
// which is what bounds the jax.numpy reference on a CPU. Padding rows are zero. K/V
// and q are float32 or bfloat16; accumulation is float32. Optionally each logit is
// soft-capped (`cap * tanh(logit / cap)`, Gemma 2) before masking, and each query head's
// sink logit (gpt-oss; -inf for none) joins the softmax denominator only.
//
// Work items are tiles of a few consecutive queries of one sequence and one KV head:
// an item reads each key once for all its queries and the query heads of its GQA
// group. A decode row (one query) is one item for all its heads (up to kRows), which
// reads each key's row of every KV head at once and prefetches the next block: decode
// is bound by reading the cache, and this was 1.6x faster at 48 rows of context 300.
// Items are shared with the threads of XLA's intra-op pool when the step has enough
// work to pay for waking them.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 16;     // query heads per KV head
constexpr int kMaxHeadDim = 256;  // head_dim
constexpr int kTile = 8;  // queries of one sequence per work item (fewer for wide groups)
constexpr int kRows = 32;  // (query, head) rows per work item
constexpr int64_t kPairsPerThread = 512;  // (query, key) pairs one more thread must have

// exp(x) for x <= 0 to about 2 ulp: a degree-6 polynomial after range reduction, written
// without calls so that the compiler vectorises the loops that use it (libm's expf is
// a scalar call, and one happens per key and query head).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
// A row of `d` cache values as float32: in place for float32, widened into `buf` else.
inline const float* AsFloat(const float* src, int64_t, float*) { return src; }
inline const float* AsFloat(const uint16_t* src, int64_t d, float* buf) {
  for (int64_t i = 0; i < d; ++i) buf[i] = ToFloat(src[i]);
  return buf;
}

inline void FromFloat(float x, float* dst) { *dst = x; }
inline void FromFloat(float x, uint16_t* dst) {  // round to nearest even, as XLA does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) {
    *dst = 0x7fc0;
    return;
  }
  bits += 0x7fff + ((bits >> 16) & 1);
  *dst = static_cast<uint16_t>(bits >> 16);
}

struct Shapes {
  int64_t num_tokens, num_heads, head_dim, block_size, num_kv_heads, num_seqs, width;
  int64_t group() const { return num_heads / num_kv_heads; }
};

// What every item shares besides the shapes: the softmax scale, the soft cap (0: none),
// the sliding window (0: none) and the per-query-head sink logits [Hq].
struct Options {
  float scale, soft_cap;
  int64_t window;
  const float* sinks;
};

// A logit after the optional soft cap.
inline float Cap(float logit, float soft_cap) {
  return soft_cap > 0.0f ? soft_cap * std::tanh(logit / soft_cap) : logit;
}

// An item's working rows, one per (query, head) it computes, in per-thread scratch on
// the heap (XLA's worker threads may have small stacks): each row's scaled query, its
// output accumulator, running max and sum, and its scores over one block.
struct Rows {
  float (*qv)[kMaxHeadDim];
  float (*acc)[kMaxHeadDim];
  float* m;
  float* l;
  float (*scores)[64];  // block_size <= 64
  float* buf;           // one widened bf16 key or value row, up to kRows * kMaxHeadDim
};

inline Rows ThreadRows() {
  thread_local std::vector<float> scratch(kRows * (3 * kMaxHeadDim + 2 + 64));
  float* s = scratch.data();
  return Rows{reinterpret_cast<float(*)[kMaxHeadDim]>(s),
              reinterpret_cast<float(*)[kMaxHeadDim]>(s + kRows * kMaxHeadDim),
              s + 2 * kRows * kMaxHeadDim,
              s + 2 * kRows * kMaxHeadDim + kRows,
              reinterpret_cast<float(*)[64]>(s + 2 * kRows * kMaxHeadDim + 2 * kRows),
              s + kRows * (2 * kMaxHeadDim + 2 + 64)};
}

// Row r starts on query `src` (d values), scaled, with nothing accumulated but its
// head's sink: the running max starts at the sink logit, whose weight is exp(0) = 1.
template <typename T>
inline void StartRow(Rows& w, int64_t r, const T* src, int64_t d, float scale, float sink) {
  for (int64_t x = 0; x < d; ++x) w.qv[r][x] = ToFloat(src[x]) * scale;
  std::fill(w.acc[r], w.acc[r] + d, 0.0f);
  w.m[r] = sink;
  w.l[r] = sink == -INFINITY ? 0.0f : 1.0f;
}

// Folds row r's scores of keys [lo, hi) of one block into its online softmax: keys it
// may see ([see_lo, see_hi)) get their weight exp(score - max), the others 0.
inline void SoftmaxBlock(Rows& w, int64_t r, int64_t d, int64_t lo, int64_t hi,
                         int64_t see_lo, int64_t see_hi) {
  float* scores = w.scores[r];
  float block_max = -INFINITY;
  for (int64_t o = see_lo; o < see_hi; ++o) block_max = std::max(block_max, scores[o]);
  const float m_new = std::max(w.m[r], block_max);
  const float correction = w.m[r] == -INFINITY ? 0.0f : ExpNonPositive(w.m[r] - m_new);
  w.l[r] *= correction;
  for (int64_t x = 0; x < d; ++x) w.acc[r][x] *= correction;  // 0 before any key
  w.m[r] = m_new;
  for (int64_t o = lo; o < hi; ++o) {
    const bool seen = o >= see_lo && o < see_hi;
    scores[o] = seen ? ExpNonPositive(scores[o] - m_new) : 0.0f;
  }
  for (int64_t o = lo; o < hi; ++o) w.l[r] += scores[o];
}

// Row r's output: its accumulator over its weights' sum.
template <typename T>
inline void FinishRow(const Rows& w, int64_t r, int64_t d, T* dst) {
  const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;
  for (int64_t x = 0; x < d; ++x) FromFloat(w.acc[r][x] * inv, dst + x);
}

// One work item: up to kTile consecutive queries of one sequence and one KV head, every
// query head of its GQA group, with an online softmax over the keys block by block.
// Query i sits at position first_pos + i and sees keys in (pos - window, pos].
// kDim > 0 fixes head_dim at compile time (its loops unrolled).
template <int kDim, typename T>
void AttendTile(const Shapes& sh, const T* q, const T* k_cache, const T* v_cache,
                const int32_t* table, int64_t first_token, int64_t first_pos, int64_t num_q,
                int64_t kv_head, const Options& opt, T* out) {
  const int64_t window = opt.window;
  const int64_t d = kDim > 0 ? kDim : sh.head_dim, g_count = sh.group(), bs = sh.block_size;
  const int64_t rows = num_q * g_count;  // (query, head) rows, query-major
  Rows w = ThreadRows();
  // Row r is query r / g_count and head kv_head * g_count + r % g_count.
  auto head_offset = [&](int64_t r) {
    return ((first_token + r / g_count) * sh.num_heads + kv_head * g_count + r % g_count) * d;
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = kv_head * g_count + r % g_count;
    StartRow(w, r, q + head_offset(r), d, opt.scale, opt.sinks[head]);
  }
  const int64_t last = first_pos + num_q - 1;  // the tile's last query position
  const int64_t first = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  for (int64_t blk = first / bs; blk <= last / bs; ++blk) {
    const int64_t lo = std::max(first, blk * bs) - blk * bs;
    const int64_t hi = std::min(last, blk * bs + bs - 1) - blk * bs + 1;
    const int64_t base = static_cast<int64_t>(table[blk]) * bs;
    for (int64_t o = lo; o < hi; ++o) {
      const float* kf = AsFloat(k_cache + ((base + o) * sh.num_kv_heads + kv_head) * d, d, w.buf);
      for (int64_t r = 0; r < rows; ++r) {
        float dot = 0.0f;
        for (int64_t x = 0; x < d; ++x) dot += w.qv[r][x] * kf[x];
        w.scores[r][o] = Cap(dot, opt.soft_cap);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      // Keys this query may not see (later positions, or out of its window) get p = 0.
      const int64_t pos = first_pos + r / g_count;
      const int64_t see_lo = std::max(lo, (window > 0 ? pos - window + 1 : 0) - blk * bs);
      const int64_t see_hi = std::min(hi, pos - blk * bs + 1);
      SoftmaxBlock(w, r, d, lo, hi, see_lo, see_hi);
    }
    for (int64_t o = lo; o < hi; ++o) {
      const float* vf = AsFloat(v_cache + ((base + o) * sh.num_kv_heads + kv_head) * d, d, w.buf);
      for (int64_t r = 0; r < rows; ++r) {
        const float p = w.scores[r][o];
        for (int64_t x = 0; x < d; ++x) w.acc[r][x] += p * vf[x];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) FinishRow(w, r, d, out + head_offset(r));
}

// A decode row: the one new query of a sequence, every head at once. Each key's row
// [Hkv, D] is read once, whole and contiguous (a block is one run of memory), where the
// per-KV-head tiles read it in Hkv strided pieces; decode attention is bound by reading
// the cache. Every head sees the same keys, so no per-row mask is needed.
template <int kDim, typename T>
void AttendDecode(const Shapes& sh, const T* q, const T* k_cache, const T* v_cache,
                  const int32_t* table, int64_t token, int64_t pos, const Options& opt,
                  T* out) {
  const int64_t window = opt.window;
  const int64_t d = kDim > 0 ? kDim : sh.head_dim, g_count = sh.group(), bs = sh.block_size;
  const int64_t rows = sh.num_heads, row_len = sh.num_kv_heads * d;
  Rows w = ThreadRows();
  for (int64_t r = 0; r < rows; ++r) {
    StartRow(w, r, q + (token * rows + r) * d, d, opt.scale, opt.sinks[r]);
  }
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  for (int64_t blk = first / bs; blk <= pos / bs; ++blk) {
    const int64_t lo = std::max(first, blk * bs) - blk * bs;
    const int64_t hi = std::min(pos, blk * bs + bs - 1) - blk * bs + 1;
    const int64_t base = static_cast<int64_t>(table[blk]) * bs;
    if (blk < pos / bs) {  // the next block is elsewhere in memory: start fetching it now
      const int64_t next = static_cast<int64_t>(table[blk + 1]) * bs * row_len;
      const int64_t bytes = bs * row_len * static_cast<int64_t>(sizeof(T));
      for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k_cache + next) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(v_cache + next) + b);
      }
    }
    for (int64_t o = lo; o < hi; ++o) {
      const float* krow = AsFloat(k_cache + (base + o) * row_len, row_len, w.buf);
      for (int64_t r = 0; r < rows; ++r) {
        const float* kf = krow + (r / g_count) * d;
        float dot = 0.0f;
        for (int64_t x = 0; x < d; ++x) dot += w.qv[r][x] * kf[x];
        w.scores[r][o] = Cap(dot, opt.soft_cap);
      }
    }
    for (int64_t r = 0; r < rows; ++r) SoftmaxBlock(w, r, d, lo, hi, lo, hi);
    for (int64_t o = lo; o < hi; ++o) {
      const float* vrow = AsFloat(v_cache + (base + o) * row_len, row_len, w.buf);
      for (int64_t r = 0; r < rows; ++r) {
        const float* vf = vrow + (r / g_count) * d;
        const float p = w.scores[r][o];
        for (int64_t x = 0; x < d; ++x) w.acc[r][x] += p * vf[x];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) FinishRow(w, r, d, out + (token * rows + r) * d);
}

struct Item {
  int64_t seq, kv_head, first_token, first_pos, num_q;  // kv_head -1: a decode row
};

template <int kDim, typename T>
void AttendItem(const Shapes& sh, const T* q, const T* k_cache, const T* v_cache,
                const int32_t* table, const Item& it, const Options& opt, T* out) {
  if (it.kv_head < 0) {
    AttendDecode<kDim>(sh, q, k_cache, v_cache, table, it.first_token, it.first_pos, opt, out);
  } else {
    AttendTile<kDim>(sh, q, k_cache, v_cache, table, it.first_token, it.first_pos, it.num_q,
                     it.kv_head, opt, out);
  }
}

// What the threads of one call share. A pool thread may start after the call returned
// (every item taken): it then only reads `next_item`, so the state outlives the call.
struct Work {
  std::vector<Item> items;
  std::atomic<size_t> next_item{0};
  std::atomic<size_t> items_done{0};
};

template <typename T>
void Attend(ffi::ThreadPool& pool, const Shapes& sh, const T* q, const T* k_cache,
            const T* v_cache, const int32_t* tables, const int32_t* seq_lens, const int32_t* qsl,
            const Options& opt, T* out) {
  std::memset(out, 0, sizeof(T) * sh.num_tokens * sh.num_heads * sh.head_dim);
  auto work = std::make_shared<Work>();
  std::vector<Item>& items = work->items;
  int64_t pairs = 0;  // (query, key) pairs, a measure of the step's work
  for (int64_t s = 0; s < sh.num_seqs; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    if (q_len <= 0 || seq_lens[s] <= 0) continue;
    const int64_t pos0 = seq_lens[s] - q_len;
    if (q_len == 1 && sh.num_heads <= kRows) {
      items.push_back({s, -1, qsl[s], pos0, 1});
      pairs += (pos0 + 1) * sh.num_kv_heads;
      continue;
    }
    const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(kTile, kRows / sh.group()));
    for (int64_t i = 0; i < q_len; i += tile) {
      const int64_t n = std::min<int64_t>(tile, q_len - i);
      for (int64_t h = 0; h < sh.num_kv_heads; ++h) {
        items.push_back({s, h, qsl[s] + i, pos0 + i, n});
      }
      pairs += n * (pos0 + i + n) * sh.num_kv_heads;
    }
  }
  // Threads take the next item as they finish one, so a thread that the OS holds back
  // (another process on its core) delays the step by an item, not by half the work; the
  // caller waits for the items taken, never for a pool thread that has not started.
  auto run = [=, &sh, &opt](Work& w) {
    for (size_t k; (k = w.next_item.fetch_add(1, std::memory_order_relaxed)) < w.items.size();) {
      const Item& it = w.items[k];
      const int32_t* table = tables + it.seq * sh.width;
      if (sh.head_dim == 64) {
        AttendItem<64>(sh, q, k_cache, v_cache, table, it, opt, out);
      } else if (sh.head_dim == 128) {
        AttendItem<128>(sh, q, k_cache, v_cache, table, it, opt, out);
      } else {
        AttendItem<0>(sh, q, k_cache, v_cache, table, it, opt, out);
      }
      w.items_done.fetch_add(1, std::memory_order_release);
    }
  };
  static const int64_t max_threads = [] {  // JVLLM_CPU_ATTENTION_THREADS caps it
    const char* env = std::getenv("JVLLM_CPU_ATTENTION_THREADS");
    return env ? std::max<int64_t>(std::atoll(env), 1) : INT64_MAX;
  }();
  const int64_t pool_threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t num_threads = std::clamp<int64_t>(
      std::min<int64_t>(pairs / kPairsPerThread, static_cast<int64_t>(items.size())), 1,
      std::min(max_threads, pool_threads));
  for (int64_t t = 1; t < num_threads; ++t) {
    // A helper that starts once every item is taken returns at once; one scheduled
    // after the call returned touches nothing but `work`, which it keeps alive.
    pool.Schedule([work, run]() mutable { run(*work); });
  }
  run(*work);
  while (work->items_done.load(std::memory_order_acquire) < items.size()) {
    std::this_thread::yield();  // a pool thread is finishing the items it took
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                           ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> seq_lens,
                           ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::F32> sinks,
                           ffi::Result<ffi::AnyBuffer> out, float scale, float soft_cap,
                           int64_t sliding_window) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention: q [T,H,D], cache [N,BS,Hkv,D], tables [S,W]");
  }
  Shapes sh{qd[0], qd[1], qd[2], kd[1], kd[2], td[0], td[1]};
  if (sh.head_dim > kMaxHeadDim || sh.block_size > 64 || sh.num_heads % sh.num_kv_heads ||
      sh.group() > kMaxGroup || kd[3] != sh.head_dim) {
    return ffi::Error::InvalidArgument("paged_attention: unsupported head_dim, block or group size");
  }
  if (sinks.element_count() != static_cast<size_t>(sh.num_heads)) {
    return ffi::Error::InvalidArgument("paged_attention: sinks must hold one logit per query head");
  }
  const Options opt{scale, soft_cap, sliding_window, sinks.typed_data()};
  const auto* tables = block_tables.typed_data();
  const auto* lens = seq_lens.typed_data();
  const auto* qsl = query_start_loc.typed_data();
  if (q.element_type() == ffi::F32) {
    Attend(pool, sh, static_cast<const float*>(q.untyped_data()),
           static_cast<const float*>(k_cache.untyped_data()),
           static_cast<const float*>(v_cache.untyped_data()), tables, lens, qsl, opt,
           static_cast<float*>(out->untyped_data()));
  } else if (q.element_type() == ffi::BF16) {
    Attend(pool, sh, static_cast<const uint16_t*>(q.untyped_data()),
           static_cast<const uint16_t*>(k_cache.untyped_data()),
           static_cast<const uint16_t*>(v_cache.untyped_data()), tables, lens, qsl, opt,
           static_cast<uint16_t*>(out->untyped_data()));
  } else {
    return ffi::Error::InvalidArgument("paged_attention: q and the cache must be f32 or bf16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window"));
