// Paged decode attention for XLA:CPU, called from jitted JAX code as an FFI custom call.
//
// The contract is kernels/reference.py's, restricted to decode rows: a sequence s with
// exactly one new token (query_start_loc[s + 1] - query_start_loc[s] == 1) attends with
// its query row t = query_start_loc[s] to its seq_lens[s] cached keys, read in place
// through its block table (no gathered copy of K or V, which is what bounds the
// jax.numpy reference on a CPU). Every other output row is zero; the caller fills the
// prefill rows itself. K/V and q are float32 or bfloat16, accumulation is float32.
//
// Work items are (sequence, KV head) pairs: one item reads each of its keys once for
// all the query heads of its GQA group. Items are split over a few threads when the
// step reads enough keys to pay for starting them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 16;     // query heads per KV head
constexpr int kMaxHeadDim = 256;  // head_dim
constexpr int64_t kKeysPerThread = 4096;  // keys one more thread must have to be worth it

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

// One (sequence, KV head) item: online softmax over the sequence's keys, block by block.
// kDim > 0 fixes head_dim at compile time (its loops unrolled, rows kept in registers).
template <int kDim, typename T>
void DecodeItem(const Shapes& sh, const T* q, const T* k_cache, const T* v_cache,
                const int32_t* table, int64_t seq_len, int64_t token, int64_t kv_head,
                float scale, int64_t window, T* out) {
  const int64_t d = kDim > 0 ? kDim : sh.head_dim, g_count = sh.group(), bs = sh.block_size;
  float qv[kMaxGroup][kMaxHeadDim];
  float acc[kMaxGroup][kMaxHeadDim];
  float m[kMaxGroup], l[kMaxGroup];
  float scores[kMaxGroup][64];  // one block of keys; block_size <= 64
  float buf[kMaxHeadDim];  // one bf16 key or value, widened
  for (int64_t g = 0; g < g_count; ++g) {
    const T* src = q + (token * sh.num_heads + kv_head * g_count + g) * d;
    for (int64_t i = 0; i < d; ++i) qv[g][i] = ToFloat(src[i]) * scale;
    std::fill(acc[g], acc[g] + d, 0.0f);
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  const int64_t last = seq_len - 1;  // the query's own position
  const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
  for (int64_t blk = first / bs; blk <= last / bs; ++blk) {
    const int64_t lo = std::max(first, blk * bs) - blk * bs;
    const int64_t hi = std::min(last, blk * bs + bs - 1) - blk * bs + 1;
    const int64_t base = static_cast<int64_t>(table[blk]) * bs;
    for (int64_t o = lo; o < hi; ++o) {
      const float* kf = AsFloat(k_cache + ((base + o) * sh.num_kv_heads + kv_head) * d, d, buf);
      for (int64_t g = 0; g < g_count; ++g) {
        float dot = 0.0f;
        for (int64_t i = 0; i < d; ++i) dot += qv[g][i] * kf[i];
        scores[g][o] = dot;
      }
    }
    for (int64_t g = 0; g < g_count; ++g) {
      float block_max = -INFINITY;
      for (int64_t o = lo; o < hi; ++o) block_max = std::max(block_max, scores[g][o]);
      const float m_new = std::max(m[g], block_max);
      const float correction = m[g] == -INFINITY ? 0.0f : ExpNonPositive(m[g] - m_new);
      l[g] *= correction;
      for (int64_t i = 0; i < d; ++i) acc[g][i] *= correction;
      m[g] = m_new;
      for (int64_t o = lo; o < hi; ++o) scores[g][o] = ExpNonPositive(scores[g][o] - m_new);
    }
    for (int64_t g = 0; g < g_count; ++g) {
      for (int64_t o = lo; o < hi; ++o) l[g] += scores[g][o];
    }
    for (int64_t o = lo; o < hi; ++o) {
      const float* vf = AsFloat(v_cache + ((base + o) * sh.num_kv_heads + kv_head) * d, d, buf);
      for (int64_t g = 0; g < g_count; ++g) {
        const float p = scores[g][o];
        for (int64_t i = 0; i < d; ++i) acc[g][i] += p * vf[i];
      }
    }
  }
  for (int64_t g = 0; g < g_count; ++g) {
    T* dst = out + (token * sh.num_heads + kv_head * g_count + g) * d;
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t i = 0; i < d; ++i) FromFloat(acc[g][i] * inv, dst + i);
  }
}

template <typename T>
void Decode(const Shapes& sh, const T* q, const T* k_cache, const T* v_cache,
            const int32_t* tables, const int32_t* seq_lens, const int32_t* qsl, float scale,
            int64_t window, T* out) {
  std::memset(out, 0, sizeof(T) * sh.num_tokens * sh.num_heads * sh.head_dim);
  std::vector<int64_t> items;  // s * num_kv_heads + kv_head
  int64_t keys = 0;
  for (int64_t s = 0; s < sh.num_seqs; ++s) {
    if (qsl[s + 1] - qsl[s] != 1 || seq_lens[s] <= 0) continue;
    for (int64_t h = 0; h < sh.num_kv_heads; ++h) items.push_back(s * sh.num_kv_heads + h);
    keys += seq_lens[s] * sh.num_kv_heads;
  }
  auto run = [&](size_t begin, size_t step) {
    for (size_t i = begin; i < items.size(); i += step) {
      const int64_t s = items[i] / sh.num_kv_heads, h = items[i] % sh.num_kv_heads;
      const int32_t* table = tables + s * sh.width;
      if (sh.head_dim == 64) {
        DecodeItem<64>(sh, q, k_cache, v_cache, table, seq_lens[s], qsl[s], h, scale, window, out);
      } else if (sh.head_dim == 128) {
        DecodeItem<128>(sh, q, k_cache, v_cache, table, seq_lens[s], qsl[s], h, scale, window, out);
      } else {
        DecodeItem<0>(sh, q, k_cache, v_cache, table, seq_lens[s], qsl[s], h, scale, window, out);
      }
    }
  };
  const int64_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const int64_t num_threads = std::clamp<int64_t>(keys / kKeysPerThread, 1, hardware);
  std::vector<std::thread> helpers;
  for (int64_t t = 1; t < num_threads; ++t) helpers.emplace_back(run, t, num_threads);
  run(0, num_threads);
  for (auto& t : helpers) t.join();
}

ffi::Error PagedDecodeImpl(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                           ffi::Buffer<ffi::S32> query_start_loc,
                           ffi::Result<ffi::AnyBuffer> out, float scale,
                           int64_t sliding_window) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode: q [T,H,D], cache [N,BS,Hkv,D], tables [S,W]");
  }
  Shapes sh{qd[0], qd[1], qd[2], kd[1], kd[2], td[0], td[1]};
  if (sh.head_dim > kMaxHeadDim || sh.block_size > 64 || sh.num_heads % sh.num_kv_heads ||
      sh.group() > kMaxGroup || kd[3] != sh.head_dim) {
    return ffi::Error::InvalidArgument("paged_decode: unsupported head_dim, block or group size");
  }
  const auto* tables = block_tables.typed_data();
  const auto* lens = seq_lens.typed_data();
  const auto* qsl = query_start_loc.typed_data();
  if (q.element_type() == ffi::F32) {
    Decode(sh, static_cast<const float*>(q.untyped_data()),
           static_cast<const float*>(k_cache.untyped_data()),
           static_cast<const float*>(v_cache.untyped_data()), tables, lens, qsl, scale,
           sliding_window, static_cast<float*>(out->untyped_data()));
  } else if (q.element_type() == ffi::BF16) {
    Decode(sh, static_cast<const uint16_t*>(q.untyped_data()),
           static_cast<const uint16_t*>(k_cache.untyped_data()),
           static_cast<const uint16_t*>(v_cache.untyped_data()), tables, lens, qsl, scale,
           sliding_window, static_cast<uint16_t*>(out->untyped_data()));
  } else {
    return ffi::Error::InvalidArgument("paged_decode: q and the cache must be f32 or bf16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JvllmPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window"));
