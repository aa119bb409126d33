// Measurement knobs: environment variables that pick among kernel variants of identical arithmetic (rows a warp
// holds at once, threads per row). Each launcher caches its knob once per process and keeps its measured
// default when the variable is unset or not a positive number. The bench records name the knobs they ran under
// (python/difuse/bench.py KERNEL_KNOBS).
#pragma once

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>

namespace difuse::detail {

// The whole of `text` as a decimal int into `out`: false (out untouched) for anything else ("on", "8x", "1e3",
// out of int's range), which the knob readers below treat as unset, saying so once on stderr per read (each
// launcher reads its knob once per process).
inline bool parse_knob_int(const char* name, const char* text, int& out) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || v < INT_MIN || v > INT_MAX) {
    std::fprintf(stderr, "difuse: %s=%s is not an integer; ignored (the default variant runs)\n", name, text);
    return false;
  }
  out = static_cast<int>(v);
  return true;
}

// The positive integer in environment variable `name`, or 0 (unset, empty, not a positive number).
inline int positive_env_knob(const char* name) {
  const char* e = std::getenv(name);
  int v = 0;
  if (e && *e && !parse_knob_int(name, e, v)) return 0;
  return v > 0 ? v : 0;
}

// The integer in environment variable `name` (0 allowed, e.g. to turn a default variant off), or `unset` when it is
// unset, empty or not an integer.
inline int env_knob_or(const char* name, int unset) {
  const char* e = std::getenv(name);
  int v = unset;
  if (e && *e && !parse_knob_int(name, e, v)) return unset;
  return v;
}

// The text of environment variable `name`, or "" when it is unset (knobs that take more than one number).
inline const char* env_knob_text(const char* name) {
  const char* e = std::getenv(name);
  return e ? e : "";
}

}  // namespace difuse::detail
