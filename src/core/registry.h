// Kernel registry: metadata only. Registering touches no CUDA context and allocates nothing on a device.
#pragma once

#include <string>
#include <vector>

#include "difuse/difuse.h"

namespace difuse::detail {

struct KernelInfo {
  std::string op, backend, contract, reference, platform;
  int min_sm = 0, max_sm = 0;
  std::string description;
};

// All registered kernels, sorted by (op, backend). Thread-safe after static initialisation.
const std::vector<KernelInfo>& registered_kernels();
// First kernel for op (and backend, when given); nullptr if none.
const KernelInfo* select_kernel(const std::string& op, const char* backend);

struct KernelRegistration {
  explicit KernelRegistration(KernelInfo info);
};

}  // namespace difuse::detail
