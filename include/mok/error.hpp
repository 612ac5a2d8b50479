// mok::Error and the argument checks every public entry point uses.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace mok {

// Every error the library raises. The message names the argument (or the phase)
// and the offending value, e.g. "mok::forward: argument 'x': dtype must be bf16, got f32".
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

}  // namespace detail

// Throws mok::Error("<where>: argument '<arg>': <parts...>").
template <typename... Parts>
[[noreturn]] void throw_argument_error(std::string_view where, std::string_view arg,
                                       const Parts&... parts) {
  throw Error(detail::concat(where, ": argument '", arg, "': ", parts...));
}

}  // namespace mok
