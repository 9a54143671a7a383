// A downstream program using posenc::io (found through the installed package's `io` component): reads
// a Hugging Face config held in a string and checks the fields it can see by eye.
#include <posenc/io/hf_config.hpp>
#include <posenc/rope.hpp>

#include <cstdio>

int main() {
  const auto cfg = nlohmann::json::parse(R"({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
                                             "rope_theta": 500000.0, "max_position_embeddings": 2048})");
  const posenc::rope r(posenc::io::rope_config_from_hf(cfg));
  if (r.head_dim() != 64 || r.rotary_dim() != 64) {
    std::printf("consumer_io: head_dim %lld, rotary_dim %lld, expected 64 and 64\n",
                static_cast<long long>(r.head_dim()), static_cast<long long>(r.rotary_dim()));
    return 1;
  }
  std::printf("consumer_io: ok\n");
  return 0;
}
