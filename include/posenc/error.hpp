// posenc/error.hpp — the one exception type of the library and the argument checks that throw it.
//
// Every public entry point validates its arguments before it writes anything, so an output is
// untouched when an error is thrown. Messages name the argument, the constraint and the value:
//   posenc: k: head_dim must equal q's head_dim 64 (got 128)
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace posenc {

/// Thrown for every invalid argument. Derives from std::invalid_argument so callers that already
/// catch the standard type keep working.
class error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

template <class... Parts>
[[nodiscard]] std::string concat(const Parts&... parts) {
  std::ostringstream os;
  os.precision(17);
  (os << ... << parts);
  return os.str();
}

}  // namespace detail

/// Throw posenc::error("posenc: <argument>: <constraint> (got <value...>)") unless `ok`.
/// The message parts after `constraint` are streamed, so numbers need no formatting by the caller.
template <class... Got>
void require(bool ok, std::string_view argument, std::string_view constraint, const Got&... got) {
  if (ok) return;
  if constexpr (sizeof...(Got) == 0) {
    throw error(detail::concat("posenc: ", argument, ": ", constraint));
  } else {
    throw error(detail::concat("posenc: ", argument, ": ", constraint, " (got ", got..., ")"));
  }
}

}  // namespace posenc
