#include "core/error.h"

#include <sstream>

namespace difuse::detail {

namespace {
thread_local std::string t_last_error;
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
