// Concurrent use: every encoding and the kernel called from 8 threads at once on shared encoding
// objects and tables, with and without one shared Eigen thread pool, must give exactly the
// single-threaded results. Built and run under ThreadSanitizer by the `tsan` preset (label
// `concurrency`), where it also proves the absence of data races on the shared objects (hooks are
// const and called concurrently: docs/design.md › The hooks). The kernel's result does not depend
// on the thread count (docs/design.md › Units of work), so the comparison is bitwise.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <unsupported/Eigen/CXX11/ThreadPool>

#include "posenc/posenc.hpp"
#include "random.hpp"

namespace {

using idx = posenc::index_t;
constexpr int client_threads = 8;
constexpr int rounds = 2;

// One problem for every encoding: several query and key blocks per (batch, head) so that work items
// split, GQA 4/2 for the families that allow it.
constexpr idx B = 2, S = 80, H = 4, D = 32, block = 32;

struct operands {
  std::vector<double> q = test_util::randn(static_cast<std::size_t>(B * S * H * D), 11);
  std::vector<double> k = test_util::randn(static_cast<std::size_t>(B * S * H * D), 12);
  std::vector<double> v = test_util::randn(static_cast<std::size_t>(B * S * H * D), 13);
};

using job = std::function<std::vector<double>(Eigen::ThreadPoolInterface*)>;

template <class E>
job attention_job(const operands& x, const E& enc, idx kv_heads, bool causal) {
  return [&x, &enc, kv_heads, causal](Eigen::ThreadPoolInterface* pool) {
    std::vector<double> out(static_cast<std::size_t>(B * S * H * D), -1.0);
    std::vector<double> lse(static_cast<std::size_t>(B * H * S), -1.0);
    posenc::attention_options opt;
    opt.causal = causal;
    opt.pool = pool;
    opt.q_block = block;
    opt.k_block = block;
    posenc::attention<double>(posenc::bshd<const double>(x.q.data(), B, S, H, D),
                              posenc::bshd<const double>(x.k.data(), B, S, kv_heads, D),
                              posenc::bshd<const double>(x.v.data(), B, S, kv_heads, D),
                              posenc::bshd(out.data(), B, S, H, D), posenc::tensor_map<double, 3>(lse.data(), B, H, S),
                              enc, opt);
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
}

bool bitwise_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

TEST_CASE("concurrency: every encoding and the kernel from 8 threads on shared objects equal one thread bitwise",
          "[concurrency]") {
  const operands x;
  const posenc::no_position plain;

  posenc::rope_config rc;
  rc.head_dim = D;
  const posenc::rope rope_exact(rc);
  posenc::rope_config yc = rc;
  yc.scaling = {.rope_type = posenc::rope_type::yarn, .factor = 4, .original_max_position_embeddings = 32};
  yc.max_position_embeddings = 128;
  const posenc::rope rope_yarn(yc);
  posenc::rope_config dc = rc;
  dc.scaling = {.rope_type = posenc::rope_type::dynamic, .factor = 2};
  dc.max_position_embeddings = 48;  // S = 80 > 48: bind computes the call's frequencies
  const posenc::rope rope_dynamic(dc);
  const auto rope_table = rope_yarn.table<double>(0, S);

  const posenc::alibi alibi({.heads = H});

  const auto t5w = test_util::randn(32 * H, 14);
  const posenc::t5_relative_bias<double> t5(posenc::tensor_map<const double, 2>(t5w.data(), 32, H));

  const idx k_clip = 6;
  const auto aK = test_util::randn(static_cast<std::size_t>((2 * k_clip + 1) * D), 15, 0.3);
  const auto aV = test_util::randn(static_cast<std::size_t>((2 * k_clip + 1) * D), 16, 0.3);
  const posenc::shaw_relative<double> shaw(posenc::tensor_map<const double, 2>(aK.data(), 2 * k_clip + 1, D),
                                           posenc::tensor_map<const double, 2>(aV.data(), 2 * k_clip + 1, D));

  const idx M = 16;
  const auto xl_w = test_util::randn(static_cast<std::size_t>(H * D * M), 17, 0.1);
  const auto xl_u = test_util::randn(static_cast<std::size_t>(H * D), 18, 0.3);
  const auto xl_v = test_util::randn(static_cast<std::size_t>(H * D), 19, 0.3);
  const posenc::transformer_xl<double> xl(posenc::tensor_map<const double, 2>(xl_w.data(), H * D, M),
                                          posenc::tensor_map<const double, 2>(xl_u.data(), H, D),
                                          posenc::tensor_map<const double, 2>(xl_v.data(), H, D),
                                          {.d_model = M, .n_head = H, .d_head = D});

  const posenc::deberta_config dbc{.heads = H, .head_dim = D, .position_buckets = 8, .max_relative_positions = 20};
  const idx hidden = 16;
  const auto db_rel = test_util::randn(static_cast<std::size_t>(16 * hidden), 20, 0.5);
  const auto db_wq = test_util::randn(static_cast<std::size_t>(H * D * hidden), 21, 0.2);
  const auto db_wk = test_util::randn(static_cast<std::size_t>(H * D * hidden), 22, 0.2);
  const auto db_bq = test_util::randn(static_cast<std::size_t>(H * D), 23, 0.1);
  const auto db_bk = test_util::randn(static_cast<std::size_t>(H * D), 24, 0.1);
  posenc::deberta_weights<double> dbw(posenc::tensor_map<const double, 2>(db_rel.data(), 16, hidden));
  dbw.query_proj = posenc::deberta_linear<double>(posenc::tensor_map<const double, 2>(db_wq.data(), H * D, hidden),
                                                  posenc::tensor_map<const double, 1>(db_bq.data(), H * D));
  dbw.key_proj = posenc::deberta_linear<double>(posenc::tensor_map<const double, 2>(db_wk.data(), H * D, hidden),
                                                posenc::tensor_map<const double, 1>(db_bk.data(), H * D));
  const posenc::deberta_disentangled deberta(dbc, dbw);

  const idx Dm = 24;
  const auto tp_pos = test_util::randn(static_cast<std::size_t>(S * Dm), 25, 0.5);
  const auto tp_uq = test_util::randn(static_cast<std::size_t>(H * D * Dm), 26, 0.2);
  const auto tp_uk = test_util::randn(static_cast<std::size_t>(H * D * Dm), 27, 0.2);
  const auto tp_bq = test_util::randn(static_cast<std::size_t>(H * D), 28, 0.1);
  const auto tp_bk = test_util::randn(static_cast<std::size_t>(H * D), 29, 0.1);
  const auto tp_rel = test_util::randn(static_cast<std::size_t>(32 * H), 30, 0.5);
  posenc::tupe_weights<double> tw{.pos_emb = {tp_pos.data(), S, Dm},
                                  .pos_q_weight = {tp_uq.data(), H * D, Dm},
                                  .pos_q_bias = {tp_bq.data(), H * D},
                                  .pos_k_weight = {tp_uk.data(), H * D, Dm},
                                  .pos_k_bias = {tp_bk.data(), H * D}};
  tw.relative_attention_bias.emplace(tp_rel.data(), 32, H);
  const posenc::tupe tupe(tw, {.num_attention_heads = H, .cls_reset = false});

  const posenc::sinusoidal sinus({.d_model = H * D});
  const auto learned_w = test_util::randn(static_cast<std::size_t>(S * H * D), 31);
  const posenc::learned_absolute<double> learned(posenc::tensor_map<const double, 2>(learned_w.data(), S, H * D));
  const auto positions = posenc::contiguous_positions(B, S);

  std::vector<std::pair<std::string, job>> jobs = {
      {"plain causal GQA", attention_job(x, plain, 2, true)},
      {"rope exact causal GQA", attention_job(x, rope_exact, 2, true)},
      {"rope yarn causal GQA", attention_job(x, rope_yarn, 2, true)},
      {"rope dynamic", attention_job(x, rope_dynamic, H, false)},
      {"alibi causal GQA", attention_job(x, alibi, 2, true)},
      {"t5", attention_job(x, t5, H, false)},
      {"shaw", attention_job(x, shaw, H, false)},
      {"transformer_xl causal", attention_job(x, xl, H, true)},
      {"deberta", attention_job(x, deberta, H, false)},
      {"tupe", attention_job(x, tupe, H, false)},
      {"rope apply with a shared table",
       [&](Eigen::ThreadPoolInterface*) {
         std::vector<double> y = x.q;
         rope_yarn.apply(posenc::bshd(y.data(), B, S, H, D), posenc::view(positions), rope_table);
         return y;
       }},
      {"sinusoidal add_to",
       [&](Eigen::ThreadPoolInterface*) {
         std::vector<double> y = x.q;
         sinus.add_to(posenc::tensor_map<double, 3>(y.data(), B, S, H * D), posenc::view(positions));
         return y;
       }},
      {"learned add_to",
       [&](Eigen::ThreadPoolInterface*) {
         std::vector<double> y = x.q;
         learned.add_to(posenc::tensor_map<double, 3>(y.data(), B, S, H * D), posenc::view(positions));
         return y;
       }},
  };

  std::vector<std::vector<double>> want;
  for (const auto& [name, run] : jobs) want.push_back(run(nullptr));

  Eigen::ThreadPool shared_pool(4);
  // results[t][r][j]: client t, round r, job j; every client starts at another job so that different
  // encodings and the same encoding run at the same time.
  const std::size_t J = jobs.size();
  std::vector<std::vector<std::vector<double>>> results(client_threads,
                                                        std::vector<std::vector<double>>(rounds * J));
  std::vector<std::string> failures(client_threads);
  std::vector<std::thread> clients;
  for (int t = 0; t < client_threads; ++t)
    clients.emplace_back([&, t] {
      try {
        for (int r = 0; r < rounds; ++r)
          for (std::size_t n = 0; n < J; ++n) {
            const std::size_t j = (n + static_cast<std::size_t>(t)) % J;
            // Half the clients share the pool in even rounds, the other half in odd rounds.
            Eigen::ThreadPoolInterface* pool = ((t + r) % 2 == 0) ? &shared_pool : nullptr;
            results[static_cast<std::size_t>(t)][static_cast<std::size_t>(r) * J + j] = jobs[j].second(pool);
          }
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(t)] = e.what();
      }
    });
  for (auto& c : clients) c.join();

  for (int t = 0; t < client_threads; ++t) {
    INFO("client " << t);
    REQUIRE(failures[static_cast<std::size_t>(t)].empty());
    for (int r = 0; r < rounds; ++r)
      for (std::size_t j = 0; j < J; ++j) {
        INFO(jobs[j].first << ", round " << r);
        CHECK(bitwise_equal(results[static_cast<std::size_t>(t)][static_cast<std::size_t>(r) * J + j], want[j]));
      }
  }
}
