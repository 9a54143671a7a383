// Ring attention over MPI: causal attention over one sequence split across P processes, exact.
//
// Every rank holds a contiguous share of the sequence — its queries, keys, values and their absolute
// positions. The K/V chunks travel around the ring (rank r sends to r+1 and receives from r-1), the
// next transfer in flight (MPI_Isend / MPI_Irecv) while the rank attends to the chunk it holds. Each
// call is `posenc::attention` with the log-sum-exp output, over explicit positions, and its result is
// folded into the rank's running output with `posenc::merge` in place, so a rank holds one running
// output and one partial, never P of them (Liu et al., "Ring Attention with Blockwise Transformers",
// 2023; the merge is FlashAttention-2's rescaling, section 3.1.1).
//
// Causal by positions: a (query chunk, key chunk) pair whose keys all lie in the queries' future is
// skipped without a call. With --layout zigzag (the default) the sequence is cut into 2P chunks and
// rank r holds chunks r and 2P-1-r, one early and one late, so every rank does the same work per ring
// step (the load balance of Brandon et al., "Striped Attention", 2023 / zigzag ring attention);
// --layout contiguous gives rank r chunk r alone (rank P-1 then does P times the work of rank 0).
//
// The encodings work from absolute positions, so they run unchanged: --encoding rope_yarn (RoPE with
// YaRN scaling), alibi (causal ALiBi) or t5 (T5 decoder buckets; encoder buckets with --bidirectional).
//
//   mpirun -np 2 build/test/examples/posenc-ring_attention_mpi --encoding rope_yarn --check
//
// --check gathers the output on rank 0 and compares it with posenc::reference_attention in double over
// the whole sequence; --runs N repeats the ring N times, reports the slowest rank's time of each run and
// checks that every run's gathered output is bitwise identical to the first. Exits non-zero on a
// mismatch, so ctest runs it as a test (label mpi).
#include <mpi.h>

#include <posenc/posenc.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace {

using Index = posenc::index_t;  // not `index`: POSIX declares ::index()

struct settings {
  std::string encoding = "rope_yarn";
  Index seq = 1024, heads = 8, kv_heads = 0, dim = 64;  // small enough for --check's reference
  int threads = 1, runs = 1;
  bool zigzag = true, causal = true, check = false;
};

[[noreturn]] void usage(int rank, const std::string& why) {
  if (rank == 0)
    std::fprintf(stderr,
                 "ring_attention_mpi: %s\n"
                 "usage: mpirun -np P ring_attention_mpi [--encoding rope_yarn|alibi|t5] [--seq L] [--heads H]\n"
                 "       [--kv-heads Hkv] [--dim d] [--threads T] [--layout zigzag|contiguous] [--bidirectional]\n"
                 "       [--runs N] [--check]\n",
                 why.c_str());
  MPI_Finalize();
  std::exit(2);
}

settings parse(int argc, char** argv, int rank) {
  settings s;
  auto number = [&](int& i) -> long long {
    if (i + 1 >= argc) usage(rank, std::string(argv[i]) + " needs a value");
    char* end = nullptr;
    const long long v = std::strtoll(argv[++i], &end, 10);
    if (end == argv[i] || *end != '\0' || v <= 0) usage(rank, std::string(argv[i - 1]) + ": must be a positive integer");
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--encoding" && i + 1 < argc) s.encoding = argv[++i];
    else if (a == "--layout" && i + 1 < argc) {
      const std::string_view l = argv[++i];
      if (l != "zigzag" && l != "contiguous") usage(rank, "--layout: must be zigzag or contiguous");
      s.zigzag = l == "zigzag";
    } else if (a == "--seq") s.seq = number(i);
    else if (a == "--heads") s.heads = number(i);
    else if (a == "--kv-heads") s.kv_heads = number(i);
    else if (a == "--dim") s.dim = number(i);
    else if (a == "--threads") s.threads = static_cast<int>(number(i));
    else if (a == "--runs") s.runs = static_cast<int>(number(i));
    else if (a == "--bidirectional") s.causal = false;
    else if (a == "--check") s.check = true;
    else usage(rank, "unknown argument " + std::string(a));
  }
  if (s.kv_heads == 0) s.kv_heads = s.heads;
  if (s.encoding != "rope_yarn" && s.encoding != "alibi" && s.encoding != "t5")
    usage(rank, "--encoding: must be rope_yarn, alibi or t5 (got " + s.encoding + ")");
  if (s.heads % s.kv_heads != 0) usage(rank, "--kv-heads: must divide --heads");
  return s;
}

// The inputs are a function of (tensor, position, head, dim) alone (a counter-based hash), so each
// rank makes only its own tokens and rank 0 can make the whole sequence for the reference.
float input(std::uint64_t tensor, std::int64_t pos, Index head, Index d) {
  std::uint64_t z = (tensor << 56) ^ (static_cast<std::uint64_t>(pos) << 24) ^ (static_cast<std::uint64_t>(head) << 12) ^
                    static_cast<std::uint64_t>(d);
  z += 0x9e3779b97f4a7c15ULL;  // splitmix64 (Steele, Lea, Flood 2014)
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  const double u = static_cast<double>(z >> 11) * 0x1p-53;  // [0, 1)
  return static_cast<float>((2.0 * u - 1.0) * std::sqrt(3.0));  // unit variance
}

// tokens [n, heads, dim] (BSHD, batch 1) at the given positions.
std::vector<float> make_tokens(std::uint64_t tensor, const std::vector<std::int64_t>& pos, Index heads, Index dim) {
  std::vector<float> x(pos.size() * static_cast<std::size_t>(heads * dim));
  std::size_t o = 0;
  for (const std::int64_t p : pos)
    for (Index h = 0; h < heads; ++h)
      for (Index d = 0; d < dim; ++d) x[o++] = input(tensor, p, h, d);
  return x;
}

constexpr Index t5_buckets = 32, t5_max_distance = 128;

std::vector<float> t5_table(Index heads) {  // [num_buckets, heads], as HF's relative_attention_bias.weight
  std::vector<float> t(static_cast<std::size_t>(t5_buckets * heads));
  for (Index b = 0; b < t5_buckets; ++b)
    for (Index h = 0; h < heads; ++h) t[static_cast<std::size_t>(b * heads + h)] = input(3, b, h, 0);
  return t;
}

posenc::rope_config rope_yarn_config(Index dim) {
  // A YaRN-extended model: 4096 pretraining positions stretched 8x (HF rope_scaling {"rope_type": "yarn"}).
  return posenc::rope_config{.head_dim = dim, .rope_theta = 1e4,
                             .scaling = {.rope_type = posenc::rope_type::yarn, .factor = 8.0,
                                         .original_max_position_embeddings = 4096},
                             .max_position_embeddings = 32768};
}

/// One rank's share of the sequence: `chunks` chunks of `chunk` tokens, concatenated.
struct shard {
  Index chunk = 0, chunks = 0;
  std::vector<std::int64_t> pos;  // [chunks * chunk]
};

shard my_shard(const settings& s, int rank, int ranks) {
  shard sh;
  const Index pieces = s.zigzag ? 2 * ranks : ranks;
  sh.chunk = s.seq / pieces;
  std::vector<Index> ids{rank};
  if (s.zigzag) ids.push_back(2 * ranks - 1 - rank);
  sh.chunks = static_cast<Index>(ids.size());
  for (const Index c : ids)
    for (Index t = 0; t < sh.chunk; ++t) sh.pos.push_back(c * sh.chunk + t);
  return sh;
}

/// The ring: runs the whole attention of this rank's queries and returns the seconds it took.
/// out [chunks * chunk, H, d] and lse [chunks][H][chunk] (each chunk's lse is its own [1, H, chunk]).
template <class E>
double ring(const settings& s, const shard& sh, const E& enc, const std::vector<float>& q,
            const std::vector<float>& k, const std::vector<float>& v, std::vector<float>& out,
            std::vector<float>& lse, Eigen::ThreadPoolInterface* pool, int rank, int ranks) {
  const Index c = sh.chunk, n = sh.chunks, H = s.heads, Hkv = s.kv_heads, D = s.dim;
  const std::size_t kv_floats = static_cast<std::size_t>(n * c * Hkv * D);
  // The travelling buffers: [K | V] floats and the positions, two of each (the one attended to, the
  // one arriving).
  std::vector<float> kv_cur(2 * kv_floats), kv_next(2 * kv_floats);
  std::vector<std::int64_t> pos_cur = sh.pos, pos_next(sh.pos.size());
  std::copy(k.begin(), k.end(), kv_cur.begin());
  std::copy(v.begin(), v.end(), kv_cur.begin() + static_cast<std::ptrdiff_t>(kv_floats));
  std::fill(out.begin(), out.end(), 0.f);
  std::fill(lse.begin(), lse.end(), -std::numeric_limits<float>::infinity());
  std::vector<float> part_out(static_cast<std::size_t>(c * H * D)), part_lse(static_cast<std::size_t>(H * c));

  const int right = (rank + 1) % ranks, left = (rank + ranks - 1) % ranks;
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < ranks; ++step) {
    MPI_Request req[4];
    int pending = 0;
    if (step + 1 < ranks) {  // start the next transfer before attending to the current chunk
      MPI_Irecv(kv_next.data(), static_cast<int>(kv_next.size()), MPI_FLOAT, left, 0, MPI_COMM_WORLD, &req[0]);
      MPI_Irecv(pos_next.data(), static_cast<int>(pos_next.size()), MPI_INT64_T, left, 1, MPI_COMM_WORLD, &req[1]);
      MPI_Isend(kv_cur.data(), static_cast<int>(kv_cur.size()), MPI_FLOAT, right, 0, MPI_COMM_WORLD, &req[2]);
      MPI_Isend(pos_cur.data(), static_cast<int>(pos_cur.size()), MPI_INT64_T, right, 1, MPI_COMM_WORLD, &req[3]);
      pending = 4;
    }
    for (Index a = 0; a < n; ++a) {      // my query chunks
      const std::int64_t* qpos = sh.pos.data() + a * c;
      const std::int64_t q_last = *std::max_element(qpos, qpos + c);
      for (Index b = 0; b < n; ++b) {  // the key chunks held this step
        const std::int64_t* kpos = pos_cur.data() + b * c;
        if (s.causal && *std::min_element(kpos, kpos + c) > q_last) continue;  // entirely in the future
        const float* kb = kv_cur.data() + b * c * Hkv * D;
        const float* vb = kv_cur.data() + kv_floats + static_cast<std::size_t>(b * c * Hkv * D);
        posenc::attention(posenc::bshd<const float>(q.data() + a * c * H * D, 1, c, H, D),
                          posenc::bshd<const float>(kb, 1, c, Hkv, D), posenc::bshd<const float>(vb, 1, c, Hkv, D),
                          posenc::bshd(part_out.data(), 1, c, H, D), posenc::tensor_map<float, 3>(part_lse.data(), 1, H, c),
                          enc,
                          posenc::attention_options{.causal = s.causal, .q_positions = posenc::positions_view(qpos, 1, c),
                                                    .k_positions = posenc::positions_view(kpos, 1, c), .pool = pool});
        // Fold the partial into the running output of query chunk a, in place (merge allows out = out_a).
        float* oa = out.data() + a * c * H * D;
        float* la = lse.data() + a * H * c;
        posenc::merge<float>(posenc::bshd<const float>(oa, 1, c, H, D), posenc::tensor_map<const float, 3>(la, 1, H, c),
                             posenc::bshd<const float>(part_out.data(), 1, c, H, D),
                             posenc::tensor_map<const float, 3>(part_lse.data(), 1, H, c), posenc::bshd(oa, 1, c, H, D),
                             posenc::tensor_map<float, 3>(la, 1, H, c));
        if (pending > 0) {  // let MPI progress the transfer between calls
          int done = 0;
          MPI_Testall(pending, req, &done, MPI_STATUSES_IGNORE);
        }
      }
    }
    if (pending > 0) {
      MPI_Waitall(pending, req, MPI_STATUSES_IGNORE);
      kv_cur.swap(kv_next);
      pos_cur.swap(pos_next);
    }
  }
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);  // a layer ends with its slowest rank
  return t;
}

/// Gathers every rank's output on rank 0 into [L, H, d] in sequence order (lse into [H, L]).
void gather(const settings& s, const shard& sh, const std::vector<float>& out, const std::vector<float>& lse,
            std::vector<float>& full_out, std::vector<float>& full_lse, int rank, int ranks) {
  const Index c = sh.chunk, n = sh.chunks, H = s.heads, D = s.dim;
  std::vector<float> all_out, all_lse;
  std::vector<std::int64_t> all_pos;
  if (rank == 0) {
    all_out.resize(out.size() * static_cast<std::size_t>(ranks));
    all_lse.resize(lse.size() * static_cast<std::size_t>(ranks));
    all_pos.resize(sh.pos.size() * static_cast<std::size_t>(ranks));
  }
  MPI_Gather(out.data(), static_cast<int>(out.size()), MPI_FLOAT, all_out.data(), static_cast<int>(out.size()), MPI_FLOAT,
             0, MPI_COMM_WORLD);
  MPI_Gather(lse.data(), static_cast<int>(lse.size()), MPI_FLOAT, all_lse.data(), static_cast<int>(lse.size()), MPI_FLOAT,
             0, MPI_COMM_WORLD);
  MPI_Gather(sh.pos.data(), static_cast<int>(sh.pos.size()), MPI_INT64_T, all_pos.data(), static_cast<int>(sh.pos.size()),
             MPI_INT64_T, 0, MPI_COMM_WORLD);
  if (rank != 0) return;
  full_out.assign(static_cast<std::size_t>(s.seq * H * D), 0.f);
  full_lse.assign(static_cast<std::size_t>(H * s.seq), 0.f);
  for (int r = 0; r < ranks; ++r)
    for (Index a = 0; a < n; ++a)
      for (Index t = 0; t < c; ++t) {
        const std::size_t src_tok = static_cast<std::size_t>((r * n + a) * c + t);
        const std::int64_t p = all_pos[src_tok];
        std::copy_n(all_out.begin() + static_cast<std::ptrdiff_t>(src_tok * static_cast<std::size_t>(H * D)), H * D,
                    full_out.begin() + static_cast<std::ptrdiff_t>(p * H * D));
        for (Index h = 0; h < H; ++h)
          full_lse[static_cast<std::size_t>(h * s.seq + p)] = all_lse[static_cast<std::size_t>((r * n + a) * H * c + h * c + t)];
      }
}

/// posenc::reference_attention in double over the whole sequence, every term written out per pair;
/// returns max|ring - ref| / max|ref| of the output and max|ring - ref| of the lse.
std::pair<double, double> check_against_reference(const settings& s, const std::vector<float>& ring_out,
                                                  const std::vector<float>& ring_lse) {
  const Index L = s.seq, H = s.heads, Hkv = s.kv_heads, D = s.dim;
  std::vector<std::int64_t> pos(static_cast<std::size_t>(L));
  for (Index i = 0; i < L; ++i) pos[static_cast<std::size_t>(i)] = i;
  auto to_double = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  std::vector<double> q = to_double(make_tokens(0, pos, H, D)), k = to_double(make_tokens(1, pos, Hkv, D)),
                      v = to_double(make_tokens(2, pos, Hkv, D));
  posenc::reference_terms<double> terms;
  posenc::attention_options opt{.causal = s.causal};
  const auto table = t5_table(H);
  const auto slopes = posenc::alibi_slopes(H);
  if (s.encoding == "rope_yarn") {  // the rotation applied up front, in double
    const posenc::rope rope(rope_yarn_config(D));
    const posenc::positions p = posenc::contiguous_positions(1, L);
    rope.apply(posenc::bshd(q.data(), 1, L, H, D), posenc::view(p));
    rope.apply(posenc::bshd(k.data(), 1, L, Hkv, D), posenc::view(p));
  } else if (s.encoding == "alibi") {  // causal form: -m_h (i - j), after the 1/sqrt(d) scale
    terms.bias = [&](Index, Index h, Index i, Index j) { return slopes[static_cast<std::size_t>(h)] * static_cast<double>(j - i); };
  } else {  // T5: the bucket of j - i looked up in the table, logits unscaled
    terms.bias = [&](Index, Index h, Index i, Index j) {
      return static_cast<double>(
          table[static_cast<std::size_t>(posenc::t5_relative_bucket(j - i, t5_buckets, t5_max_distance, !s.causal) * H + h)]);
    };
    opt.scale = 1.0;
  }
  std::vector<double> ref(static_cast<std::size_t>(L * H * D)), ref_lse(static_cast<std::size_t>(H * L));
  posenc::reference_attention<double>(posenc::bshd<const double>(q.data(), 1, L, H, D),
                                      posenc::bshd<const double>(k.data(), 1, L, Hkv, D),
                                      posenc::bshd<const double>(v.data(), 1, L, Hkv, D),
                                      posenc::bshd(ref.data(), 1, L, H, D), opt, terms, std::nullopt,
                                      posenc::tensor_map<double, 3>(ref_lse.data(), 1, H, L));
  double err = 0, mag = 0, lse_err = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(ring_out[i]) - ref[i]));
    mag = std::max(mag, std::abs(ref[i]));
  }
  for (std::size_t i = 0; i < ref_lse.size(); ++i)
    lse_err = std::max(lse_err, std::abs(static_cast<double>(ring_lse[i]) - ref_lse[i]));
  return {err / mag, lse_err};
}

template <class E>
int run(const settings& s, const E& enc, int rank, int ranks) {
  const shard sh = my_shard(s, rank, ranks);
  const std::vector<float> q = make_tokens(0, sh.pos, s.heads, s.dim), k = make_tokens(1, sh.pos, s.kv_heads, s.dim),
                           v = make_tokens(2, sh.pos, s.kv_heads, s.dim);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(sh.chunks * s.heads * sh.chunk));
  std::unique_ptr<Eigen::ThreadPool> pool;
  if (s.threads > 1) pool = std::make_unique<Eigen::ThreadPool>(s.threads);

  bool ok = true;
  std::vector<float> first_out, first_lse, full_out, full_lse;
  for (int r = 0; r < s.runs; ++r) {
    const double t = ring(s, sh, enc, q, k, v, out, lse, pool.get(), rank, ranks);
    if (rank == 0) std::printf("run %d: %.3f s (slowest rank)\n", r + 1, t);
    if (s.runs == 1 && !s.check) break;
    gather(s, sh, out, lse, full_out, full_lse, rank, ranks);
    if (rank != 0) continue;
    if (r == 0) {
      first_out = full_out;
      first_lse = full_lse;
    } else if (std::memcmp(first_out.data(), full_out.data(), full_out.size() * sizeof(float)) != 0 ||
               std::memcmp(first_lse.data(), full_lse.data(), full_lse.size() * sizeof(float)) != 0) {
      std::printf("run %d: output differs from run 1 (not bitwise identical)\n", r + 1);
      ok = false;
    }
  }
  if (rank == 0 && s.runs > 1 && ok) std::printf("all %d runs bitwise identical\n", s.runs);
  if (rank == 0 && s.check) {
    const auto [rel, lse_err] = check_against_reference(s, first_out, first_lse);
    // float kernel vs double oracle, as in examples/demo.cpp; the lse is O(log L) in size
    const bool pass = rel < 2e-5 && lse_err < 1e-4;
    std::printf("vs double reference: max|ring-ref|/max|ref| = %.2e, max|lse diff| = %.2e  %s\n", rel, lse_err,
                pass ? "ok" : "FAILED");
    ok &= pass;
  }
  int fail = ok ? 0 : 1;
  MPI_Bcast(&fail, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return fail;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const settings s = parse(argc, argv, rank);
  const Index pieces = s.zigzag ? 2 * ranks : ranks;
  if (s.seq % pieces != 0)
    usage(rank, "--seq: must be a multiple of " + std::to_string(pieces) + " (" + (s.zigzag ? "2 x " : "") +
                    "the rank count) (got " + std::to_string(s.seq) + ")");
  // MPI counts are int: one rank's K/V share travels as one message of 2 * (L / P) * Hkv * d floats.
  if (2 * (s.seq / ranks) * s.kv_heads * s.dim > std::numeric_limits<int>::max())
    usage(rank, "--seq: a rank's K/V share exceeds one MPI message (2^31 - 1 floats); use more ranks");
  if (rank == 0)
    std::printf("ring attention: %d ranks x %d threads, L=%td (%s, %td-token chunks), H=%td/%td, d=%td, %s, %s\n",
                ranks, s.threads, s.seq, s.zigzag ? "zigzag" : "contiguous", s.seq / pieces, s.heads, s.kv_heads, s.dim,
                s.encoding.c_str(), s.causal ? "causal" : "bidirectional");
  int rc = 1;
  try {
    if (s.encoding == "rope_yarn") {
      rc = run(s, posenc::rope(rope_yarn_config(s.dim)), rank, ranks);
    } else if (s.encoding == "alibi") {
      rc = run(s, posenc::alibi(posenc::alibi_config{.heads = s.heads}), rank, ranks);
    } else {
      const std::vector<float> table = t5_table(s.heads);
      rc = run(s,
               posenc::t5_relative_bias<float>(posenc::tensor_map<const float, 2>(table.data(), t5_buckets, s.heads),
                                               posenc::t5_config{.num_buckets = t5_buckets,
                                                                 .max_distance = t5_max_distance,
                                                                 .is_decoder = s.causal}),
               rank, ranks);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ring_attention_mpi (rank %d): %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
