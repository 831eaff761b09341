// The VNNI tiles of this tree against a baseline's (namespace mvold, extracted by bench/quant_tile.py
// --cpu-time), in one process, alternating: ./quant_tile_compare TYPE M ROUNDS SETS.
// One row (or M) against Qwen3-4B's shapes (K, N): a ~384 KiB slice run again and again ("small":
// from L2, the tile's arithmetic) and distinct copies of the whole weight, 256 MB ("large": from
// memory), on 2 MiB-aligned buffers (huge pages where THP allows, as the engine's weights). One
// thread is timed by its CPU time (robust to the shared machine's other loads); two threads by
// wall time, splitting each product's panels and meeting at a barrier, as a decode step does.
// The panel order is quant_gemm.cpp's run_task's (one or two rows: strided groups).
#include "old/quant_tiles.h"
#include "quant_tiles.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <ctime>
#include <vector>
#include <immintrin.h>

using Clock = std::chrono::steady_clock;

static uint16_t to_half(float f) { return _cvtss_sh(f, 0); }

#include <sys/mman.h>
// 2 MiB-aligned, on huge pages where THP allows (as the engine's weight region)
template <typename T>
struct HugeAlloc {
  using value_type = T;
  HugeAlloc() = default;
  template <typename U> HugeAlloc(const HugeAlloc<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = (n * sizeof(T) + (2 << 20) - 1) & ~size_t((2 << 20) - 1);
    void* p = std::aligned_alloc(2 << 20, bytes);
    madvise(p, bytes, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  bool operator==(const HugeAlloc&) const { return true; }
  bool operator!=(const HugeAlloc&) const { return false; }
};
struct Weight {
  std::vector<uint8_t, HugeAlloc<uint8_t>> data;
  int64_t type, K, N, P, R, rb;
  // the same weights in the baseline's records where its format differs (a baseline whose Q4_K /
  // Q5_K records kept each 6-bit scale in a byte: 320 header bytes), else empty
  std::vector<uint8_t, HugeAlloc<uint8_t>> old_data;
  int64_t old_rb = 0;
};

// w's records as the baseline lays them out, where that differs: Q4_K's and Q5_K's 6-bit scales
// and minimums as bytes, sc[8][16] then mn[8][16], after d and dmin.
void add_old_records(Weight& w) {
  const auto of = mvold::quant_format(w.type);
  if (of.record_bytes() == w.rb) return;
  const auto f = minivllm::quant_format(w.type);
  if (!minivllm::has_sub_block_min(w.type) || of.header_bytes != 320 || of.block_bytes != f.block_bytes) {
    fprintf(stderr, "no conversion to the baseline's records of type %ld\n", w.type);
    exit(1);
  }
  w.old_rb = of.record_bytes();
  w.old_data.resize(w.P * w.R * w.old_rb);
  for (int64_t p = 0; p < w.P * w.R; ++p) {
    const uint8_t* r = w.data.data() + p * w.rb;
    uint8_t* o = w.old_data.data() + p * w.old_rb;
    memcpy(o, r, 64);
    for (int j = 0; j < 8; ++j)
      for (int row = 0; row < 16; ++row) {
        o[64 + 16 * j + row] = minivllm::sub_block_scale(r, j, row, false);
        o[192 + 16 * j + row] = minivllm::sub_block_scale(r, j, row, true);
      }
    memcpy(o + 320, r + f.header_bytes, 8 * f.block_bytes);
  }
}

Weight make_weight(int64_t type, int64_t K, int64_t N, std::mt19937& g) {
  const auto f = minivllm::quant_format(type);
  Weight w{{}, type, K, N, (N + 15) / 16, K / f.record_k(), f.record_bytes()};
  w.data.resize(w.P * w.R * w.rb);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> small(1e-4f, 1e-3f);
  for (auto& b : w.data) b = byte(g);
  for (int64_t p = 0; p < w.P * w.R; ++p) {
    uint8_t* r = w.data.data() + p * w.rb;
    if (type == minivllm::kQ4_K || type == minivllm::kQ5_K) {  // the packed 6-bit scales take any byte
      for (int i = 0; i < 32; ++i) { uint16_t h = to_half(small(g)); memcpy(r + 2 * i, &h, 2); }
    } else if (type == minivllm::kQ6_K) {
      for (int i = 0; i < 16; ++i) { uint16_t h = to_half(small(g)); memcpy(r + 2 * i, &h, 2); }
    }
  }
  add_old_records(w);
  return w;
}

struct Acts {
  std::vector<int8_t> q;
  std::vector<minivllm::BlockActs> b;
  minivllm::QuantActs a;
  mvold::QuantActs ao;
};

void make_acts(Acts& x, int64_t M, int64_t K, std::mt19937& g) {
  std::normal_distribution<float> n;
  std::vector<float> f(M * K);
  for (auto& v : f) v = n(g);
  x.q.resize(M * K);
  x.b.resize(M * K / 32);
  minivllm::quantize_rows_avx512(f.data(), M, K, K, x.q.data(), x.b.data());
  x.a = {x.q.data(), x.b.data(), K, K / 32};
  x.ao = {x.q.data(), reinterpret_cast<const mvold::BlockActs*>(x.b.data()), K, K / 32};
}

// runs panels [p0, p1) of w for rows M (tiles of up to 4)
template <bool kNew>
void run_panels(const Weight& w, const Acts& x, int64_t M, int64_t p0, int64_t p1, float* out) {
  alignas(64) float acc2[256];
  const bool own = kNew || w.old_data.empty();
  const uint8_t* data = own ? w.data.data() : w.old_data.data();
  const int64_t pb = w.R * (own ? w.rb : w.old_rb);
  int64_t p = p0;
  if (kNew && M <= 2) {
    const int64_t group = minivllm::quant_tile_panels(w.type, M);
    const int64_t span = (p1 - p0) / group;
    if (group > 1 && span > 0) {
      for (int64_t i = 0; i < span; ++i) {
        minivllm::quant_tile_vnni(w.type, M, x.a, 0, data + (p0 + i) * pb, w.R, acc2, group, span * pb);
        for (int64_t q = 0; q < group; ++q)
          for (int64_t r = 0; r < M; ++r) memcpy(out + r * w.P * 16 + (p0 + q * span + i) * 16, acc2 + 16 * (q * M + r), 64);
      }
      p = p0 + group * span;
    }
  }
  for (; p < p1; ++p) {
    const uint8_t* panel = data + p * pb;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m0);
      if (kNew) minivllm::quant_tile_vnni(w.type, rows, x.a, m0, panel, w.R, acc2);
      else mvold::quant_tile_vnni(w.type, rows, x.ao, m0, panel, w.R, acc2);
      for (int64_t r = 0; r < rows; ++r) memcpy(out + (m0 + r) * w.P * 16 + p * 16, acc2 + 16 * r, 64);
    }
  }
}

struct Barrier {
  std::atomic<int64_t> count{0};
  int64_t n;
  void wait(int64_t& phase) {
    ++phase;
    count.fetch_add(1);
    for (int spin = 0; count.load(std::memory_order_acquire) < phase * n; ++spin) {
      if (spin < 4096) _mm_pause(); else std::this_thread::yield();
    }
  }
};

// chain: for rep: for each weight: split panels among T threads, barrier.
template <bool kNew>
double chain(const std::vector<Weight>& ws, const Acts& x, int64_t M, int T, int reps, std::vector<float>& out) {
  Barrier bar;
  bar.n = T;
  auto body = [&](int t) {
    int64_t phase = 0;
    for (int r = 0; r < reps; ++r)
      for (const auto& w : ws) {
        const int64_t per = (w.P + T - 1) / T, p0 = std::min(w.P, t * per), p1 = std::min(w.P, p0 + per);
        run_panels<kNew>(w, x, M, p0, p1, out.data());
        bar.wait(phase);
      }
  };
  if (T == 1) {  // the thread's CPU time: robust to the machine's other loads
    timespec a, b;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    body(0);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    return ((b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec)) / reps;
  }
  const auto start = Clock::now();
  {
    std::thread other(body, 1);
    body(0);
    other.join();
  }
  return std::chrono::duration<double>(Clock::now() - start).count() / reps;
}

int main(int argc, char** argv) {
  const int64_t type = argc > 1 ? atoll(argv[1]) : minivllm::kQ4_K;
  const int64_t M = argc > 2 ? atoll(argv[2]) : 1;
  const int rounds = argc > 3 ? atoi(argv[3]) : 5;
  const char* which = argc > 4 ? argv[4] : "small,large";
  std::mt19937 g(1);
  struct Shape { int64_t K, N; };
  const std::vector<Shape> shapes = {{2560, 9728}, {9728, 2560}, {2560, 4096}};
  const auto f = minivllm::quant_format(type);
  Acts x;
  make_acts(x, M, 9728, g);
  std::vector<float> out(M * 9728 + 64), out_old(M * 9728 + 64);
  // correctness on each shape
  for (auto s : shapes) {
    Weight w = make_weight(type, s.K, s.N, g);
    Acts xs;
    make_acts(xs, M, s.K, g);
    std::vector<float> a(M * w.P * 16), b(M * w.P * 16);
    run_panels<true>(w, xs, M, 0, w.P, a.data());
    run_panels<false>(w, xs, M, 0, w.P, b.data());
    double maxd = 0, maxv = 0;
    for (size_t i = 0; i < a.size(); ++i) { maxd = std::max(maxd, (double)fabs(a[i] - b[i])); maxv = std::max(maxv, (double)fabs(b[i])); }
    printf("check K=%ld N=%ld: max |new-old| %.3g of max %.3g\n", s.K, s.N, maxd, maxv);
  }
  for (const char* set : {"small", "large"}) {
    if (!strstr(which, set)) continue;
    const bool small = strcmp(set, "small") == 0;
    for (auto s : shapes) {
      // small: a ~384 KiB slice of whole panels, run again and again; large: copies of the weight, >= 256 MB
      std::vector<Weight> ws;
      int64_t bytes = 0;
      if (small) {
        const int64_t panel_bytes = s.K / f.record_k() * f.record_bytes();
        const int64_t n = std::max<int64_t>(2, (384 << 10) / panel_bytes) * 16;
        ws.push_back(make_weight(type, s.K, n, g));
        bytes = ws[0].data.size();
      } else {
        while (bytes < (256 << 20)) { ws.push_back(make_weight(type, s.K, s.N, g)); bytes += ws.back().data.size(); }
      }
      int64_t records = 0;
      for (auto& w : ws) records += w.P * w.R;
      const int reps = small ? std::max<int64_t>(1, (int64_t)(4e8 / bytes)) : 1;
      for (int T : {1, 2}) {
        std::vector<double> tn, to;
        for (int r = 0; r < rounds; ++r) {
          to.push_back(chain<false>(ws, x, M, T, reps, out_old));
          tn.push_back(chain<true>(ws, x, M, T, reps, out));
        }
        std::sort(tn.begin(), tn.end());
        std::sort(to.begin(), to.end());
        const double mo = to[to.size() / 2], mn = tn[tn.size() / 2];
        const double bo = to[0], bn = tn[0];
        printf("%-5s K=%5ld N=%5ld %5.2f MB T=%d M=%ld  median old %6.1f new %6.1f GB/s (x%.3f) %5.1f -> %5.1f ns/rec | best old %6.1f new %6.1f GB/s (x%.3f)\n",
               set, s.K, ws[0].N, bytes / 1e6, T, M, bytes / mo / 1e9, bytes / mn / 1e9, mo / mn,
               mo * T / records * 1e9, mn * T / records * 1e9, bytes / bo / 1e9, bytes / bn / 1e9, bo / bn);
        fflush(stdout);
      }
    }
  }
}
