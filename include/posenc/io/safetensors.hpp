// posenc/io/safetensors.hpp — read and write the safetensors format (Hugging Face weights, the golden
// reference vectors, posenc-run's outputs).
//
// Layout (https://github.com/huggingface/safetensors, "Format" section of its README):
//   bytes [0, 8)      N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8+N)    a UTF-8 JSON object: name -> {"dtype", "shape", "data_offsets": [begin, end]},
//                     plus an optional "__metadata__" object of string -> string
//   bytes [8+N, end)  the data buffer; offsets are relative to its start, payloads are row-major
//                     little-endian.
//
// The reader validates everything before it hands out a byte (a file from the internet is untrusted
// input): N <= 100 MB and within the file, a JSON object without repeated names, per tensor a dtype of
// the format, a shape of non-negative integers, offsets inside the data buffer with end - begin ==
// numel x dtype size, and the payloads tiling the data buffer: no two overlapping, no byte between or
// after them (the reference implementation's validate: InvalidOffset, MetadataIncompleteBuffer). Every
// violation is a posenc::error naming the file, the tensor and the rule.
// Payload offsets need not be aligned (an odd F32 tensor shifts the next one by 4 bytes), so values
// are copied out with memcpy and never read through a cast pointer.
//
// Dtypes: F64, F32, F16, BF16 (read as float or double; half types through Eigen::half /
// Eigen::bfloat16), I64, I32 (read as int64 or int32, range-checked). The format's other dtypes (BOOL,
// U8, I8, I16, U16, U32, U64, F8_E4M3, F8_E5M2, F8_E8M0, C64: quantized experts, FP8 checkpoints) are
// listed as dtype::other with their bytes, so the rest of such a file can be read; converting them
// is refused. The writer produces the
// canonical form: names sorted, payloads packed back to back in that order, header right-padded with
// spaces to a multiple of 8 bytes.
//
// Reading a file maps it (POSIX mmap, read-only) where the platform has it, so opening a multi-GB
// checkpoint to take a few tensors from it reads the header and those tensors' pages, not the file
// (what the reference implementation's safe_open does); elsewhere, or on request, the file is read
// into memory.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unsupported/Eigen/CXX11/Tensor>
#include <utility>
#include <vector>

#include "posenc/error.hpp"

#if __has_include(<sys/mman.h>) && __has_include(<sys/stat.h>) && __has_include(<fcntl.h>) && __has_include(<unistd.h>)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define POSENC_SAFETENSORS_MMAP 1
#else
#define POSENC_SAFETENSORS_MMAP 0
#endif

namespace posenc::io {

static_assert(std::endian::native == std::endian::little,
              "posenc/io/safetensors.hpp copies little-endian payloads directly; big-endian hosts are not supported");

/// Element types of the format this library reads and writes; `other`: a dtype of the format it only
/// lists (tensor_info::format_dtype names it).
enum class dtype { f64, f32, f16, bf16, i64, i32, other };

namespace detail {

struct format_dtype {
  std::string_view name;
  dtype type;
  std::size_t bytes;
};

/// The dtypes of the format (safetensors' Dtype, whole-byte ones) and their element sizes; the first
/// six are the ones posenc converts.
inline constexpr format_dtype format_dtypes[] = {
    {"F64", dtype::f64, 8},   {"F32", dtype::f32, 4},       {"F16", dtype::f16, 2},       {"BF16", dtype::bf16, 2},
    {"I64", dtype::i64, 8},   {"I32", dtype::i32, 4},       {"BOOL", dtype::other, 1},    {"U8", dtype::other, 1},
    {"I8", dtype::other, 1},  {"F8_E4M3", dtype::other, 1}, {"F8_E5M2", dtype::other, 1}, {"F8_E8M0", dtype::other, 1},
    {"I16", dtype::other, 2}, {"U16", dtype::other, 2},     {"U32", dtype::other, 4},     {"U64", dtype::other, 8},
    {"C64", dtype::other, 8}};

/// The table's entry of a format name, or null.
[[nodiscard]] inline const format_dtype* parse_dtype(std::string_view s) {
  for (const auto& d : format_dtypes)
    if (s == d.name) return &d;
  return nullptr;
}

/// "F64, F32, ...": the names of the dtypes posenc converts (`all`: every dtype of the format).
[[nodiscard]] inline std::string dtype_names(bool all) {
  std::string out;
  for (const auto& d : format_dtypes)
    if (all || d.type != dtype::other) out += (out.empty() ? "" : ", ") + std::string(d.name);
  return out;
}

}  // namespace detail

/// The format's name of a dtype ("F64", ...; "other" for dtype::other, whose tensors name their own).
[[nodiscard]] inline std::string_view dtype_name(dtype t) {
  if (t == dtype::other) return "other";
  for (const auto& d : detail::format_dtypes)
    if (d.type == t) return d.name;
  return "?";
}

/// Bytes per element (0 for dtype::other: tensor_info::element_bytes()).
[[nodiscard]] inline std::size_t dtype_size(dtype t) {
  if (t == dtype::other) return 0;
  for (const auto& d : detail::format_dtypes)
    if (d.type == t) return d.bytes;
  return 0;
}

[[nodiscard]] inline bool is_floating(dtype t) {
  return t == dtype::f64 || t == dtype::f32 || t == dtype::f16 || t == dtype::bf16;
}

/// The dtype a C++ element type is stored as (double, float, Eigen::half, Eigen::bfloat16, int64, int32).
template <class T>
[[nodiscard]] constexpr dtype dtype_of() {
  if constexpr (std::is_same_v<T, double>)
    return dtype::f64;
  else if constexpr (std::is_same_v<T, float>)
    return dtype::f32;
  else if constexpr (std::is_same_v<T, Eigen::half>)
    return dtype::f16;
  else if constexpr (std::is_same_v<T, Eigen::bfloat16>)
    return dtype::bf16;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return dtype::i64;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return dtype::i32;
  else
    static_assert(sizeof(T) == 0, "posenc::io: unsupported element type");
}

namespace detail {

/// 100 MB: the limit the reference implementation puts on the header, so a corrupt length cannot make
/// the reader allocate gigabytes.
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

[[noreturn]] inline void fail(const std::string& source, const std::string& what) {
  throw error("posenc: safetensors " + source + ": " + what);
}

/// The bytes of a safetensors file: an image held in memory, or a read-only mapping of the file,
/// unmapped when the last safetensors_file sharing it is gone.
class file_image {
 public:
  explicit file_image(std::vector<unsigned char> bytes)
      : owned_(std::move(bytes)), data_(owned_.data()), size_(owned_.size()) {}
  file_image(const file_image&) = delete;
  file_image& operator=(const file_image&) = delete;
  ~file_image() {
#if POSENC_SAFETENSORS_MMAP
    if (mapped_) ::munmap(const_cast<unsigned char*>(data_), size_);
#endif
  }

  /// The file mapped read-only, or null where it cannot be (no mmap on this platform, not a regular
  /// file, empty, or refused by the file system): the caller reads it instead, with its own errors.
  [[nodiscard]] static std::shared_ptr<const file_image> map(const std::filesystem::path& path) {
#if POSENC_SAFETENSORS_MMAP
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return nullptr;
    struct stat st {};
    void* p = MAP_FAILED;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0)
      p = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);  // the mapping keeps the file
    if (p == MAP_FAILED) return nullptr;
    return std::shared_ptr<const file_image>(
        new file_image(static_cast<const unsigned char*>(p), static_cast<std::size_t>(st.st_size)));
#else
    (void)path;
    return nullptr;
#endif
  }

  [[nodiscard]] const unsigned char* data() const {
    return data_;
  }
  [[nodiscard]] std::size_t size() const {
    return size_;
  }
  [[nodiscard]] bool mapped() const {
    return mapped_;
  }

 private:
  file_image(const unsigned char* p, std::size_t n) : data_(p), size_(n), mapped_(true) {}
  std::vector<unsigned char> owned_;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
  bool mapped_ = false;
};

/// Read one element of type `from` at `p` (unaligned) as T. Float <-> integer conversions are refused
/// by the caller; here only widening/narrowing within a family happens.
template <class T>
[[nodiscard]] T load_as(dtype from, const unsigned char* p) {
  switch (from) {
    case dtype::f64: {
      double x;
      std::memcpy(&x, p, 8);
      return static_cast<T>(x);
    }
    case dtype::f32: {
      float x;
      std::memcpy(&x, p, 4);
      return static_cast<T>(x);
    }
    case dtype::f16: {
      std::uint16_t bits;
      std::memcpy(&bits, p, 2);
      return static_cast<T>(static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits)));
    }
    case dtype::bf16: {
      std::uint16_t bits;
      std::memcpy(&bits, p, 2);
      return static_cast<T>(static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(bits)));
    }
    case dtype::i64: {
      std::int64_t x;
      std::memcpy(&x, p, 8);
      return static_cast<T>(x);
    }
    case dtype::i32: {
      std::int32_t x;
      std::memcpy(&x, p, 4);
      return static_cast<T>(x);
    }
    case dtype::other:  // refused before any load (check_convertible)
      break;
  }
  return T{};
}

}  // namespace detail

/// One tensor's header entry.
struct tensor_info {
  std::string name;
  io::dtype dtype = io::dtype::f64;
  std::string format_dtype = "F64";  ///< the header's name (F32, U8, F8_E4M3, ...)
  std::vector<std::int64_t> shape;   ///< row-major; [] = a scalar (one element)
  std::uint64_t begin = 0, end = 0;  ///< byte offsets into the data buffer

  [[nodiscard]] std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  [[nodiscard]] int rank() const { return static_cast<int>(shape.size()); }
  [[nodiscard]] std::size_t element_bytes() const { return detail::parse_dtype(format_dtype)->bytes; }
};

/// How safetensors_file::read reads a file.
struct safetensors_read_options {
  /// Map the file read-only where the platform has mmap (the pages of the header and of the tensors
  /// read are all that is loaded); false: read the whole file into memory.
  bool memory_map = true;
};

/// A parsed and validated safetensors file, mapped or held in memory; copies share it.
class safetensors_file {
 public:
  /// Read and validate a file: mapped read-only where the platform has mmap (unless
  /// options.memory_map is false), otherwise read into memory. A mapped file must not be truncated
  /// or rewritten while this object or a copy of it lives (a read of a vanished page is a SIGBUS, as
  /// with any mapping); read it into memory when another process may change it.
  [[nodiscard]] static safetensors_file read(const std::filesystem::path& path,
                                             const safetensors_read_options& options = {}) {
    // A directory opens as a stream on Linux, and its "size" would be taken for gigabytes of data.
    std::error_code ec;
    require(!std::filesystem::is_directory(path, ec), "safetensors", "must be a file, not a directory", path.string());
    if (options.memory_map)
      if (auto image = detail::file_image::map(path)) return from_image(std::move(image), path.string());
    std::ifstream f(path, std::ios::binary);
    require(static_cast<bool>(f), "safetensors", "cannot open file", path.string());
    f.seekg(0, std::ios::end);
    const auto size = static_cast<std::streamoff>(f.tellg());
    require(static_cast<bool>(f) && size >= 0, "safetensors", "cannot determine the file size", path.string());
    f.seekg(0, std::ios::beg);
    std::vector<unsigned char> bytes(static_cast<std::size_t>(size));
    if (size > 0) f.read(reinterpret_cast<char*>(bytes.data()), size);
    require(static_cast<bool>(f), "safetensors", "read error", path.string());
    return parse(std::move(bytes), path.string());
  }

  /// Validate an in-memory file image. `source` names it in error messages.
  [[nodiscard]] static safetensors_file parse(std::vector<unsigned char> bytes, std::string source = "<memory>") {
    return from_image(std::make_shared<const detail::file_image>(std::move(bytes)), std::move(source));
  }

  /// Whether the file is mapped (read), rather than held in memory.
  [[nodiscard]] bool mapped() const { return image_->mapped(); }
  [[nodiscard]] const std::string& source() const { return source_; }
  [[nodiscard]] bool contains(const std::string& name) const { return index_.count(name) != 0; }
  /// Tensor names, sorted.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> n;
    n.reserve(index_.size());
    for (const auto& [k, v] : index_) n.push_back(k);
    return n;
  }
  [[nodiscard]] std::size_t size() const { return index_.size(); }
  /// The `__metadata__` entries (empty when absent).
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }

  [[nodiscard]] const tensor_info& info(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) detail::fail(source_, "no tensor '" + name + "'");
    return it->second;
  }
  [[nodiscard]] std::vector<std::int64_t> shape(const std::string& name) const { return info(name).shape; }

  /// The raw little-endian payload (unaligned; copy with memcpy).
  [[nodiscard]] std::span<const unsigned char> bytes(const std::string& name) const {
    const auto& t = info(name);
    return {payload(t), static_cast<std::size_t>(t.end - t.begin)};
  }

  /// The values as T, row-major. T = double or float accepts every float dtype (F16/BF16 are widened
  /// exactly, F64 -> float rounds); T = int64_t or int32_t accepts I64 and I32 (narrowing is
  /// range-checked). Integer <-> float is refused: it is almost always a wrong tensor name.
  template <class T>
  [[nodiscard]] std::vector<T> values(const std::string& name) const {
    const auto& t = info(name);
    check_convertible<T>(t);
    const std::size_t n = static_cast<std::size_t>(t.numel()), w = t.element_bytes();
    std::vector<T> v(n);
    const unsigned char* p = payload(t);
    if (t.dtype == dtype_of<T>()) {
      if (n) std::memcpy(v.data(), p, n * w);
      return v;
    }
    for (std::size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, std::int32_t>) {
        const std::int64_t x = detail::load_as<std::int64_t>(t.dtype, p + i * w);
        if (x < std::numeric_limits<std::int32_t>::min() || x > std::numeric_limits<std::int32_t>::max())
          detail::fail(source_, "tensor '" + name + "': element " + std::to_string(i) + " = " + std::to_string(x) +
                                    " does not fit in int32");
        v[i] = static_cast<std::int32_t>(x);
      } else {
        v[i] = detail::load_as<T>(t.dtype, p + i * w);
      }
    }
    return v;
  }

  /// The tensor as an owning row-major Eigen tensor of rank R (R must equal the stored rank).
  template <class T, int R>
  [[nodiscard]] Eigen::Tensor<T, R, Eigen::RowMajor> tensor(const std::string& name) const {
    const auto& t = info(name);
    if (t.rank() != R)
      detail::fail(source_, "tensor '" + name + "': rank is " + std::to_string(t.rank()) + ", requested rank " +
                                std::to_string(R));
    Eigen::array<Eigen::Index, R> dims{};
    for (int r = 0; r < R; ++r) dims[r] = static_cast<Eigen::Index>(t.shape[static_cast<std::size_t>(r)]);
    Eigen::Tensor<T, R, Eigen::RowMajor> out(dims);
    const auto v = values<T>(name);
    if (!v.empty()) std::memcpy(out.data(), v.data(), v.size() * sizeof(T));
    return out;
  }

 private:
  /// The first byte of a tensor's payload in the file image.
  [[nodiscard]] const unsigned char* payload(const tensor_info& t) const {
    return image_->data() + data_start_ + t.begin;
  }

  template <class T>
  void check_convertible(const tensor_info& t) const {
    constexpr dtype want = dtype_of<T>();
    if (t.dtype == dtype::other)
      detail::fail(source_, "tensor '" + t.name + "': stored as " + t.format_dtype +
                                ", which posenc does not convert (it reads " + detail::dtype_names(false) +
                                "; bytes() gives the raw payload)");
    if (is_floating(want) != is_floating(t.dtype) || want == dtype::f16 || want == dtype::bf16) {
      if (t.dtype == want) return;
      detail::fail(source_, "tensor '" + t.name + "': stored as " + std::string(dtype_name(t.dtype)) +
                                ", cannot be read as " + std::string(dtype_name(want)));
    }
  }

  [[nodiscard]] static safetensors_file from_image(std::shared_ptr<const detail::file_image> image,
                                                   std::string source) {
    safetensors_file out;
    out.source_ = std::move(source);
    out.image_ = std::move(image);
    out.validate();
    return out;
  }

  void validate() {
    const std::string& src = source_;
    const unsigned char* bytes = image_->data();
    const std::size_t size = image_->size();
    if (size < 8)
      detail::fail(src, "truncated: " + std::to_string(size) + " bytes, the 8-byte header length is missing");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
    if (n > detail::max_header_bytes)
      detail::fail(src, "header length " + std::to_string(n) + " exceeds the 100 MB limit");
    if (n > size - 8)
      detail::fail(src, "header length " + std::to_string(n) + " extends beyond the file (" + std::to_string(size - 8) +
                            " bytes after the length)");
    data_start_ = 8 + static_cast<std::size_t>(n);
    const std::uint64_t data_size = size - data_start_;

    nlohmann::json header;
    std::set<std::string> seen;  // a repeated name would silently keep its last entry
    std::string repeated;
    const auto note_names = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (depth == 1 && event == nlohmann::json::parse_event_t::key && !seen.insert(parsed.get<std::string>()).second &&
          repeated.empty())
        repeated = parsed.get<std::string>();
      return true;
    };
    try {
      header = nlohmann::json::parse(bytes + 8, bytes + data_start_, note_names);
    } catch (const nlohmann::json::exception& e) {
      detail::fail(src, std::string("header is not valid JSON: ") + e.what());
    }
    if (!repeated.empty()) detail::fail(src, "tensor '" + repeated + "': the name appears twice in the header");
    if (!header.is_object()) detail::fail(src, std::string("header must be a JSON object, got ") + header.type_name());

    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) detail::fail(src, "__metadata__ must be an object of strings");
        for (const auto& [k, v] : entry.items()) {
          if (!v.is_string()) detail::fail(src, "__metadata__ entry '" + k + "' must be a string");
          metadata_.emplace(k, v.get<std::string>());
        }
        continue;
      }
      index_.emplace(name, parse_entry(name, entry, data_size));
    }

    // The payloads tile the data buffer: no two share a byte (a crafted file could alias tensors
    // otherwise), and none is left between or after them (bytes no tensor owns).
    std::vector<const tensor_info*> by_offset;
    for (const auto& [k, t] : index_)
      if (t.end > t.begin) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
    std::uint64_t covered = 0;
    const tensor_info* last = nullptr;
    for (const tensor_info* t : by_offset) {
      if (t->begin < covered)
        detail::fail(src, "tensor '" + t->name + "': data_offsets [" + std::to_string(t->begin) + ", " +
                              std::to_string(t->end) + ") overlap tensor '" + last->name + "' [" +
                              std::to_string(last->begin) + ", " + std::to_string(last->end) + ")");
      if (t->begin > covered)
        detail::fail(src, "tensor '" + t->name + "': data_offsets [" + std::to_string(t->begin) + ", " +
                              std::to_string(t->end) + ") leave bytes [" + std::to_string(covered) + ", " +
                              std::to_string(t->begin) + ") of the data buffer to no tensor");
      covered = t->end;
      last = t;
    }
    if (covered != data_size)
      detail::fail(src, "the data buffer has " + std::to_string(data_size - covered) +
                            " bytes after the last tensor's [" + std::to_string(covered) +
                            " bytes], which belong to no tensor");
  }

  tensor_info parse_entry(const std::string& name, const nlohmann::json& e, std::uint64_t data_size) const {
    const std::string& src = source_;
    auto bad = [&](const std::string& what) { detail::fail(src, "tensor '" + name + "': " + what); };
    if (!e.is_object()) bad("entry must be an object");
    tensor_info t;
    t.name = name;
    if (!e.contains("dtype") || !e.at("dtype").is_string()) bad("missing string field 'dtype'");
    const auto ds = e.at("dtype").get<std::string>();
    const detail::format_dtype* fd = detail::parse_dtype(ds);
    if (fd == nullptr) bad("unknown dtype '" + ds + "' (the format's: " + detail::dtype_names(true) + ")");
    t.dtype = fd->type;
    t.format_dtype = ds;
    if (!e.contains("shape") || !e.at("shape").is_array()) bad("missing array field 'shape'");
    std::uint64_t numel = 1;
    for (const auto& s : e.at("shape")) {
      if (!s.is_number_integer() || (s.is_number_integer() && !s.is_number_unsigned() && s.get<std::int64_t>() < 0))
        bad("shape entries must be non-negative integers, got " + s.dump());
      const auto d = s.get<std::uint64_t>();
      if (d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          (d != 0 && numel > std::numeric_limits<std::uint64_t>::max() / 16 / d))
        bad("shape " + e.at("shape").dump() + " is too large");
      numel *= d;
      t.shape.push_back(static_cast<std::int64_t>(d));
    }
    if (!e.contains("data_offsets") || !e.at("data_offsets").is_array() || e.at("data_offsets").size() != 2 ||
        !e.at("data_offsets")[0].is_number_unsigned() || !e.at("data_offsets")[1].is_number_unsigned())
      bad("data_offsets must be [begin, end] with non-negative integers");
    t.begin = e.at("data_offsets")[0].get<std::uint64_t>();
    t.end = e.at("data_offsets")[1].get<std::uint64_t>();
    if (t.begin > t.end)
      bad("data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] have begin > end");
    if (t.end > data_size)
      bad("data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
          "] reach beyond the data buffer of " + std::to_string(data_size) + " bytes");
    const std::uint64_t want = numel * fd->bytes;
    if (t.end - t.begin != want)
      bad("data_offsets span " + std::to_string(t.end - t.begin) + " bytes but shape " + e.at("shape").dump() + " of " +
          ds + " needs " + std::to_string(want));
    return t;
  }

  std::string source_;
  std::shared_ptr<const detail::file_image> image_;
  std::size_t data_start_ = 0;
  std::map<std::string, tensor_info> index_;
  std::map<std::string, std::string> metadata_;
};

/// Read and validate a safetensors file (mapped where the platform has mmap: safetensors_file::read).
[[nodiscard]] inline safetensors_file read_safetensors(const std::filesystem::path& path,
                                                       const safetensors_read_options& options = {}) {
  return safetensors_file::read(path, options);
}

/// Builds a safetensors file: add tensors in any order, then bytes() or write(path).
class safetensors_writer {
 public:
  /// Add a tensor stored as the dtype of T, from row-major values.
  template <class T>
  safetensors_writer& add(const std::string& name, std::vector<std::int64_t> shape, std::span<const T> values) {
    return add_as<T>(name, dtype_of<T>(), std::move(shape), values);
  }
  template <class T>
  safetensors_writer& add(const std::string& name, std::vector<std::int64_t> shape, const std::vector<T>& values) {
    return add<T>(name, std::move(shape), std::span<const T>(values));
  }

  /// Add a tensor converted to `stored` (e.g. double values written as F32, F16 or BF16; the float
  /// conversions round to nearest even). Integer <-> float conversions are refused.
  template <class T>
  safetensors_writer& add_as(const std::string& name, dtype stored, std::vector<std::int64_t> shape,
                             std::span<const T> values) {
    require(!name.empty() && name != "__metadata__", "safetensors_writer",
            "tensor name must be non-empty and not __metadata__", name);
    require(entries_.count(name) == 0, "safetensors_writer", "duplicate tensor name", name);
    require(stored != dtype::other, "safetensors_writer", "writes " + detail::dtype_names(false) + ", not dtype::other",
            name);
    require(is_floating(stored) == is_floating(dtype_of<T>()), "safetensors_writer",
            "cannot convert between integer and float dtypes", name, ": ", dtype_name(dtype_of<T>()), " -> ",
            dtype_name(stored));
    std::int64_t numel = 1;
    for (auto s : shape) {
      require(s >= 0, "safetensors_writer", "shape entries must be >= 0", name, " has ", s);
      numel *= s;
    }
    require(static_cast<std::int64_t>(values.size()) == numel, "safetensors_writer",
            "value count must equal the product of the shape", name, ": ", values.size(), " values for ", numel);
    entry e{stored, std::move(shape), {}};
    const std::size_t w = dtype_size(stored);
    e.bytes.resize(values.size() * w);
    if constexpr (std::is_integral_v<T>) {
      if (stored == dtype::i32)
        for (std::size_t i = 0; i < values.size(); ++i)
          require(values[i] >= std::numeric_limits<std::int32_t>::min() &&
                      values[i] <= std::numeric_limits<std::int32_t>::max(),
                  "safetensors_writer", "value does not fit in I32", name, "[", i, "] = ", values[i]);
    }
    for (std::size_t i = 0; i < values.size(); ++i) store(stored, values[i], e.bytes.data() + i * w);
    entries_.emplace(name, std::move(e));
    return *this;
  }

  /// Add an Eigen row-major tensor (any rank) under its own dtype.
  template <class T, int R>
  safetensors_writer& add(const std::string& name, const Eigen::Tensor<T, R, Eigen::RowMajor>& t) {
    std::vector<std::int64_t> shape;
    for (int r = 0; r < R; ++r) shape.push_back(static_cast<std::int64_t>(t.dimension(r)));
    return add<T>(name, std::move(shape), std::span<const T>(t.data(), static_cast<std::size_t>(t.size())));
  }

  safetensors_writer& metadata(const std::string& key, const std::string& value) {
    metadata_[key] = value;
    return *this;
  }

  /// The file image: header with sorted names, packed payloads, header padded with spaces to 8 bytes.
  [[nodiscard]] std::vector<unsigned char> bytes() const {
    nlohmann::json header = nlohmann::json::object();
    std::uint64_t offset = 0;
    for (const auto& [name, e] : entries_) {  // std::map: sorted by name
      header[name] = {{"dtype", std::string(dtype_name(e.type))},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + e.bytes.size()}}};
      offset += e.bytes.size();
    }
    if (!metadata_.empty()) header["__metadata__"] = metadata_;
    std::string h = header.dump();
    h.append((8 - h.size() % 8) % 8, ' ');
    std::vector<unsigned char> out(8 + h.size() + offset);
    const std::uint64_t n = h.size();
    for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<unsigned char>(n >> (8 * i));
    std::memcpy(out.data() + 8, h.data(), h.size());
    std::size_t at = 8 + h.size();
    for (const auto& [name, e] : entries_) {
      if (!e.bytes.empty()) std::memcpy(out.data() + at, e.bytes.data(), e.bytes.size());
      at += e.bytes.size();
    }
    return out;
  }

  void write(const std::filesystem::path& path) const {
    const auto b = bytes();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    require(static_cast<bool>(f), "safetensors_writer", "cannot open file for writing", path.string());
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    require(static_cast<bool>(f), "safetensors_writer", "write error", path.string());
  }

 private:
  struct entry {
    dtype type;
    std::vector<std::int64_t> shape;
    std::vector<unsigned char> bytes;
  };

  template <class T>
  static void store(dtype to, const T& x, unsigned char* p) {
    auto put = [p](const auto& y) { std::memcpy(p, &y, sizeof(y)); };
    if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
      store(to, static_cast<float>(x), p);
    } else {
      switch (to) {
        case dtype::f64:
          put(static_cast<double>(x));
          break;
        case dtype::f32:
          put(static_cast<float>(x));
          break;
        case dtype::f16:
          put(Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(static_cast<float>(x))));
          break;
        case dtype::bf16:
          put(Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(static_cast<float>(x))));
          break;
        case dtype::i64:
          put(static_cast<std::int64_t>(x));
          break;
        case dtype::i32:
          put(static_cast<std::int32_t>(x));
          break;
        case dtype::other:  // refused by add_as
          break;
      }
    }
  }

  std::map<std::string, entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace posenc::io
