// Compiled by the ctest `consumer.rejects_hookless_type`, which expects compilation to FAIL:
// attention() is constrained on posenc::attention_encoding and this type has no hook.
#include <posenc/posenc.hpp>

struct not_an_encoding {
  int irrelevant = 0;
};

int main() {
  std::vector<float> buf(16);
  auto x = posenc::bshd(buf.data(), 1, 2, 1, 8);
  posenc::heads_view<const float> c = x;
  posenc::attention(c, c, c, x, not_an_encoding{});
}
