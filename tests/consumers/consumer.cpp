// A downstream program: includes the umbrella header, runs plain attention on a tiny case and checks
// the one number it can compute by hand (one key: the output is that key's value).
#include <posenc/posenc.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

// Every family is reachable through the umbrella header alone.
static_assert(posenc::encoding<posenc::rope> && posenc::encoding<posenc::alibi> &&
              posenc::encoding<posenc::t5_relative_bias<float>> && posenc::encoding<posenc::shaw_keys<float>> &&
              posenc::encoding<posenc::transformer_xl<float>> && posenc::encoding<posenc::tupe> &&
              posenc::encoding<posenc::deberta_disentangled>);

int main() {
  std::vector<float> q(4, 0.5f), k(4, 0.25f), v{1.f, 2.f, 3.f, 4.f}, out(4, 0.f);
  posenc::attention(posenc::heads_view<const float>(posenc::bshd(q.data(), 1, 1, 1, 4)),
                    posenc::heads_view<const float>(posenc::bshd(k.data(), 1, 1, 1, 4)),
                    posenc::heads_view<const float>(posenc::bshd(v.data(), 1, 1, 1, 4)),
                    posenc::bshd(out.data(), 1, 1, 1, 4), posenc::no_position{});
  for (int d = 0; d < 4; ++d)
    if (std::fabs(out[d] - v[d]) > 1e-6f) {
      std::printf("consumer: out[%d] = %g, expected %g\n", d, out[d], v[d]);
      return 1;
    }
  std::printf("consumer: ok\n");
  return 0;
}
