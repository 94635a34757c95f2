// Error-message text for TORCH_CHECK, built without std::ostream number
// formatting. Built with GCC 13 (an H200 host's /opt/gcc), a TORCH_CHECK that
// streams an integer crashes inside the .so's own instantiation of
// ostream::_M_insert<long>, while string insertion works (seen:
// docs/journal/code-comments.md). Every check with more than a literal message
// therefore passes one std::string built here.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace dash_fa3 {

inline std::string to_text(const std::string& s) { return s; }
inline std::string to_text(const char* s) { return s; }
inline std::string to_text(at::ScalarType t) { return c10::toString(t); }
inline std::string to_text(const at::Device& d) {
  return std::string(d.is_cuda() ? "cuda:" : "cpu:") + std::to_string(static_cast<int>(d.index()));
}
inline std::string to_text(at::IntArrayRef a) {
  std::string out = "[";
  for (size_t i = 0; i < a.size(); ++i) out += (i ? ", " : "") + std::to_string(a[i]);
  return out + "]";
}
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
std::string to_text(T v) {
  return std::to_string(v);
}

template <class... Args>
std::string msg(const Args&... args) {
  std::string out;
  ((out += to_text(args)), ...);
  return out;
}

}  // namespace dash_fa3
