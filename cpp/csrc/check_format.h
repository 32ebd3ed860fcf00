// Integer and shape formatting for the extension's error messages, without std::ostream.
//
// Why: TORCH_CHECK builds its message with c10::str, i.e. an std::ostringstream, and `os << 42`
// or `os << t.sizes()` instantiates ostream's numeric insertion (num_put) in our _C.so. On the
// GPU image (extension built with /opt/gcc/bin/g++, torch 2.11+cu130 built with another
// toolchain) that instantiation ran against the process's own libstdc++ locale facets and every
// bad-input check that formatted a number or a shape segfaulted instead of raising:
//   #0 std::codecvt<char16_t, ...>::do_unshift                        (in _C.so)
//   #1 std::basic_ostream<char>::_M_insert<long>(long)                (in _C.so)
//   #2 c10::detail::_str_wrapper<char const*, ..., long const&, ..., c10::ArrayRef<long> const&>::call
//   #3 ldsparse::check_spmm   #4 ldsparse::spmm_cuda
// Messages made of strings only (devices and dtypes print through strings) raised fine. So every
// message here formats numbers with std::to_string and hands c10::str strings only; the text is
// byte-identical to what c10 printed before ("[a, b]" for shapes). tests/unit/test_sparse_messages.py
// pins the messages and rejects a TORCH_CHECK argument that is not a string, num() or shape().
// (torch's own inline headers still format an int in one error path we cannot reach:
// c10::fromIntArrayRefSlow, behind at::zeros({n}, ...), fails only for sizes below -2^62.)
#pragma once
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace ldsparse {

// Decimal text of an integer, as `std::ostream << v` prints it in the C locale.
template <typename T, typename = std::enable_if_t<std::is_integral<T>::value>>
inline std::string num(T v) {
  return std::to_string(v);
}

// "[a, b, c]", as c10's operator<<(ostream&, ArrayRef) prints t.sizes().
inline std::string shape(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + "]";
}

}  // namespace ldsparse
