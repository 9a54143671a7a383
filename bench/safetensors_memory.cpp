// Peak resident memory and time of taking one small tensor from a large safetensors file, the file
// mapped (read_safetensors' default where mmap exists) or read into memory ({.memory_map = false}),
// as a host does that reads a T5 bias table or gpt-oss's sinks from a multi-GB checkpoint shard. The
// file: one F32 tensor of SIZE MiB (a sparse file: its zeros cost no disk) and a 32 x 8 F32 table
// after it. The peak RSS of the whole process (getrusage ru_maxrss) is the measurement, one mode per
// process. Usage: safetensors_memory map|read [SIZE_MiB = 2048] [FILE]
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <posenc/io/safetensors.hpp>
#include <string>
#include <vector>

namespace {

double peak_rss_mib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // KiB on Linux
}

/// The file, written without holding its payload: header, the table, then the big tensor's bytes as a
/// hole (resize_file).
void write_file(const std::filesystem::path& path, std::uint64_t big_bytes) {
  const std::uint64_t table_bytes = 32 * 8 * 4;
  std::string header = R"({"relative_attention_bias":{"dtype":"F32","shape":[32,8],"data_offsets":[0,)" +
                       std::to_string(table_bytes) + R"(]},"weight":{"dtype":"F32","shape":[)" +
                       std::to_string(big_bytes / 4) + R"(],"data_offsets":[)" + std::to_string(table_bytes) + "," +
                       std::to_string(table_bytes + big_bytes) + "]}}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f << header;
  for (int i = 0; i < 32 * 8; ++i) {
    const float x = 0.01f * static_cast<float>(i);
    f.write(reinterpret_cast<const char*>(&x), sizeof x);
  }
  f.close();
  std::filesystem::resize_file(path, 8 + n + table_bytes + big_bytes);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "map";
  if (mode != "map" && mode != "read") {
    std::fprintf(stderr, "usage: safetensors_memory map|read [SIZE_MiB] [FILE]\n");
    return 2;
  }
  const std::uint64_t mib = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 2048;
  const std::filesystem::path path =
      argc > 3 ? std::filesystem::path(argv[3])
               : std::filesystem::temp_directory_path() / "posenc_safetensors_memory.safetensors";
  write_file(path, mib << 20);
  const double before = peak_rss_mib();
  const auto t0 = std::chrono::steady_clock::now();
  const auto file = posenc::io::read_safetensors(path, {.memory_map = mode == "map"});
  const auto table = file.values<float>("relative_attention_bias");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double after = peak_rss_mib();
  std::filesystem::remove(path);
  std::printf(
      "%s: file %.0f MiB, mapped %d, one 32 x 8 table read (table[255] = %g) in %.3f ms; peak RSS %.1f MiB "
      "before the read, %.1f MiB after (+%.1f MiB)\n",
      mode.c_str(), static_cast<double>(mib), file.mapped() ? 1 : 0, static_cast<double>(table[255]), seconds * 1e3,
      before, after, after - before);
  return 0;
}
