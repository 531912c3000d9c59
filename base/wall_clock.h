// cpfill/base/wall_clock.h — the wall clock (system clock) in seconds since the Unix epoch, as
// timelines record it to line up ranks and processes (steady clocks time the intervals).
#pragma once

#include <chrono>

namespace cpfill {

inline double UnixSecondsNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace cpfill
