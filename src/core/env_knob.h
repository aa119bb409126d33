// Measurement knobs: environment variables that pick among kernel variants of identical arithmetic (rows a warp
// holds at once, threads per row). Each launcher caches its knob once per process and keeps its measured
// default when the variable is unset or not a positive number. The bench records name the knobs they ran under
// (python/difuse/bench.py KERNEL_KNOBS).
#pragma once

#include <cstdlib>

namespace difuse::detail {

// The positive integer in environment variable `name`, or 0 (unset, empty, not a positive number).
inline int positive_env_knob(const char* name) {
  const char* e = std::getenv(name);
  const int v = e ? std::atoi(e) : 0;
  return v > 0 ? v : 0;
}

// The integer in environment variable `name` (0 allowed, e.g. to turn a default variant off), or `unset` when it is
// unset or empty.
inline int env_knob_or(const char* name, int unset) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoi(e) : unset;
}

// The text of environment variable `name`, or "" when it is unset (knobs that take more than one number).
inline const char* env_knob_text(const char* name) {
  const char* e = std::getenv(name);
  return e ? e : "";
}

}  // namespace difuse::detail
