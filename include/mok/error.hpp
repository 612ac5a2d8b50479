// mok::Error and the argument checks every public entry point uses.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace mok {

// Every error the library raises derives from mok::Error; its type says what went wrong
// (the Python extension maps the types to Python's exceptions):
//   mok::Error          the library or the device failed: a CUDA error, a timed-out wait on
//                       the GPU, an internal inconsistency (Python: RuntimeError)
//   mok::ArgumentError  an argument is wrong: its shape, device, layout or values (an expert
//                       id out of range, more routed rows than the capacity) (ValueError)
//   mok::DTypeError     an argument has the wrong dtype (TypeError)
// The message names the argument (or the phase) and the offending value, e.g.
// "mok::forward: argument 'x': dtype must be bf16, got f32".
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  // Throws an error of this one's type whose message is `prefix` + this message.
  [[noreturn]] virtual void rethrow_with_prefix(std::string_view prefix) const {
    throw Error(std::string(prefix) + what());
  }
};

class ArgumentError : public Error {
 public:
  using Error::Error;
  [[noreturn]] void rethrow_with_prefix(std::string_view prefix) const override {
    throw ArgumentError(std::string(prefix) + what());
  }
};

class DTypeError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
  [[noreturn]] void rethrow_with_prefix(std::string_view prefix) const override {
    throw DTypeError(std::string(prefix) + what());
  }
};

namespace detail {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

}  // namespace detail

// Throws mok::ArgumentError("<where>: argument '<arg>': <parts...>").
template <typename... Parts>
[[noreturn]] void throw_argument_error(std::string_view where, std::string_view arg,
                                       const Parts&... parts) {
  throw ArgumentError(detail::concat(where, ": argument '", arg, "': ", parts...));
}

// Throws mok::DTypeError("<where>: argument '<arg>': <parts...>").
template <typename... Parts>
[[noreturn]] void throw_dtype_error(std::string_view where, std::string_view arg, const Parts&... parts) {
  throw DTypeError(detail::concat(where, ": argument '", arg, "': ", parts...));
}

}  // namespace mok
