#include "core/error.h"

#include <sstream>

namespace difuse::detail {

namespace {
thread_local std::string t_last_error;
}

namespace {
bool word_char(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }
}  // namespace

void Support::rename(const std::string& from, const std::string& to) {
  if (from.empty()) return;
  for (std::string& v : violations) {
    for (size_t at = v.find(from); at != std::string::npos; at = v.find(from, at)) {
      const size_t end = at + from.size();
      if ((at == 0 || !word_char(v[at - 1])) && (end == v.size() || !word_char(v[end]))) {
        v.replace(at, from.size(), to);
        at += to.size();
      } else {
        at = end;
      }
    }
  }
}

void set_last_error(const std::string& msg) { t_last_error = msg; }
void clear_last_error() { t_last_error.clear(); }
const std::string& last_error() { return t_last_error; }

std::string Support::message(const char* op) const {
  std::ostringstream os;
  os << "difuse::" << op << ": unsupported input (" << violations.size() << " violated precondition"
     << (violations.size() == 1 ? "" : "s") << "):";
  for (const auto& v : violations) os << "\n  - " << v;
  return os.str();
}

void throw_cuda(cudaError_t err, const char* call, const char* file, int line) {
  std::ostringstream os;
  os << "CUDA error " << cudaGetErrorName(err) << " (" << static_cast<int>(err) << "): " << cudaGetErrorString(err)
     << " in " << call << " at " << file << ":" << line;
  throw Failure(DIFUSE_ERR_CUDA, os.str());
}

}  // namespace difuse::detail
