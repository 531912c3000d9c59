// cpfill/base/string_view.h — std::string_view as absl::string_view. Debian's Abseil is built with
// its own absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0), which StrCat, StrSplit,
// SimpleAtoi and Abseil's hash maps do not take from a std::string_view directly.
//
//   absl::StrCat("\"", Sv(name), "\" is unknown")
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace cpfill {

inline absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace cpfill
