#include "core/registry.h"

#include <algorithm>
#include <mutex>

namespace difuse::detail {

namespace {
std::vector<KernelInfo>& table() {
  static std::vector<KernelInfo> t;
  return t;
}
std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace

KernelRegistration::KernelRegistration(KernelInfo info) {
  std::lock_guard<std::mutex> lock(table_mutex());
  auto& t = table();
  t.push_back(std::move(info));
  std::stable_sort(t.begin(), t.end(), [](const KernelInfo& a, const KernelInfo& b) {
    return a.op != b.op ? a.op < b.op : a.backend < b.backend;
  });
}

const std::vector<KernelInfo>& registered_kernels() { return table(); }

const KernelInfo* select_kernel(const std::string& op, const char* backend) {
  for (const auto& k : table())
    if (k.op == op && (backend == nullptr || k.backend == backend)) return &k;
  return nullptr;
}

}  // namespace difuse::detail
