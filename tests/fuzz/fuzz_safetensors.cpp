// libFuzzer target: posenc::io::safetensors_file::parse on arbitrary bytes, then every accessor on
// every tensor it accepts. Any input must either parse or throw posenc::error; ASan/UBSan report
// everything else (out-of-bounds reads from a bad offset, overflow in numel, huge allocations).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "posenc/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto f = posenc::io::safetensors_file::parse(std::vector<unsigned char>(data, data + size));
    for (const std::string& name : f.names()) {
      const posenc::io::tensor_info& t = f.info(name);
      (void)f.bytes(name);
      try {
        if (posenc::io::is_floating(t.dtype)) {
          (void)f.values<double>(name);
          (void)f.values<float>(name);
          if (t.rank() == 2) (void)f.tensor<float, 2>(name);
        } else {
          (void)f.values<std::int64_t>(name);
          (void)f.values<std::int32_t>(name);
        }
      } catch (const posenc::error&) {
        // int64 -> int32 out of range: a documented error.
      }
    }
  } catch (const posenc::error&) {
    // Rejected input: the expected outcome for most of the space.
  }
  return 0;
}
