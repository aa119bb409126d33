// Internal error plumbing: exceptions inside the library, statuses at the C ABI.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "difuse/difuse.h"

namespace difuse::detail {

// Thrown inside the library; c_api.cpp turns it into a status plus the thread's last-error text.
class Failure : public std::runtime_error {
 public:
  Failure(difuse_status status, const std::string& msg) : std::runtime_error(msg), status_(status) {}
  difuse_status status() const { return status_; }

 private:
  difuse_status status_;
};

// The predicate's answer: ok, or every violated precondition.
struct Support {
  std::vector<std::string> violations;
  bool ok() const { return violations.empty(); }
  // "difuse::<op>: unsupported input (N violated preconditions):\n  - a\n  - b"
  std::string message(const char* op) const;
  // Every whole-word `from` in the reasons becomes `to`: a predicate that asks another op's predicate (with its h in
  // x's place, its weight in scale's) names its own tensors.
  void rename(const std::string& from, const std::string& to);
};

void set_last_error(const std::string& msg);
void clear_last_error();

[[noreturn]] void throw_cuda(cudaError_t err, const char* call, const char* file, int line);

}  // namespace difuse::detail

// Records a violated precondition; the message is only built when the condition fails (predicates run
// on every launch, so the passing path must not allocate).
#define DIFUSE_REQUIRE(support, cond, ...)                                 \
  do {                                                                     \
    if (!(cond)) (support).violations.push_back(__VA_ARGS__);              \
  } while (0)

// Every CUDA runtime call in the library goes through this.
#define DIFUSE_CUDA_CHECK(call)                                                         \
  do {                                                                                  \
    cudaError_t difuse_err_ = (call);                                                   \
    if (difuse_err_ != cudaSuccess) ::difuse::detail::throw_cuda(difuse_err_, #call, __FILE__, __LINE__); \
  } while (0)
