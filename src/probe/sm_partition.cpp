// sm_partition — see sm_partition.h. Driver calls, in order: cuDeviceGet, cuDeviceGetDevResource (the device's SMs),
// cuDevSmResourceSplitByCount (one group of at least `sms`, SM co-scheduling ignored so the count can be fine),
// cuDevResourceGenerateDesc, cuGreenCtxCreate, cuGreenCtxStreamCreate. Each is fetched once by name for the ABI of
// the cuda.h it is compiled with and each result is checked; a failure names the call and the driver's error name.
#include "probe/sm_partition.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

#include "core/device.h"
#include "core/error.h"

namespace difuse::probe {
namespace {

using detail::Failure;

// The ABI of the cuda.h these calls are declared by (cuGreenCtxStreamCreate is not in 12.4's).
constexpr unsigned kDriverAbi = CUDA_VERSION;

template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  DIFUSE_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, kDriverAbi, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr)
    throw Failure(DIFUSE_ERR_UNSUPPORTED, std::string("sm_partition: the CUDA driver has no ") + name +
                                              " (green-context streams need a CUDA 12.5 driver or newer; asked for "
                                              "the ABI of CUDA " + std::to_string(kDriverAbi) + ")");
  return reinterpret_cast<Fn>(fn);
}

void check(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return;
  static const auto error_name = driver_entry<decltype(&cuGetErrorName)>("cuGetErrorName");
  const char* text = nullptr;
  if (error_name(r, &text) != CUDA_SUCCESS || text == nullptr) text = "unknown error";
  throw Failure(DIFUSE_ERR_CUDA, std::string("sm_partition: ") + call + " failed: " + text + " (" +
                                     std::to_string(static_cast<int>(r)) + ")");
}

// sms in [1, the device's own SM count] (not the launch override's: a partition is a part of the device).
void check_count(int device, int sms) {
  const int have = detail::device_sm_count(device);
  if (sms < 1 || sms > have)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, "sm_partition: " + std::to_string(sms) + " SMs asked for; device " +
                                                   std::to_string(device) + " has " + std::to_string(have) +
                                                   " (allowed: 1.." + std::to_string(have) + ")");
}

}  // namespace

SmPartitionStream create_sm_partition_stream(int device, int sms) {
  detail::device_slot(device);
  check_count(device, sms);
  static const auto device_get = driver_entry<decltype(&cuDeviceGet)>("cuDeviceGet");
  static const auto get_resource = driver_entry<decltype(&cuDeviceGetDevResource)>("cuDeviceGetDevResource");
  static const auto split = driver_entry<decltype(&cuDevSmResourceSplitByCount)>("cuDevSmResourceSplitByCount");
  static const auto describe = driver_entry<decltype(&cuDevResourceGenerateDesc)>("cuDevResourceGenerateDesc");
  static const auto green_create = driver_entry<decltype(&cuGreenCtxCreate)>("cuGreenCtxCreate");
  static const auto stream_create = driver_entry<decltype(&cuGreenCtxStreamCreate)>("cuGreenCtxStreamCreate");

  detail::DeviceGuard guard(device);
  DIFUSE_CUDA_CHECK(cudaFree(nullptr));  // the primary context exists and is current before the green one is made
  CUdevice dev = 0;
  check(device_get(&dev, device), "cuDeviceGet");
  CUdevResource all{};
  check(get_resource(dev, &all, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource");
  CUdevResource group{};
  CUdevResource rest{};
  unsigned groups = 1;
  check(split(&group, &groups, &all, &rest, CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING,
              static_cast<unsigned>(sms)),
        "cuDevSmResourceSplitByCount");
  if (groups != 1)
    throw Failure(DIFUSE_ERR_CUDA, "sm_partition: cuDevSmResourceSplitByCount made " + std::to_string(groups) +
                                       " groups of at least " + std::to_string(sms) + " SMs, not one");
  CUdevResourceDesc desc = nullptr;
  check(describe(&desc, &group, 1), "cuDevResourceGenerateDesc");
  CUgreenCtx green = nullptr;
  check(green_create(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate");
  CUstream stream = nullptr;
  check(stream_create(&stream, green, CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate");
  SmPartitionStream out;
  out.stream = reinterpret_cast<cudaStream_t>(stream);
  out.sms = static_cast<int>(group.sm.smCount);
  return out;
}

void set_launch_sm_count(int device, int sms) {
  detail::device_slot(device);
  if (sms < 0)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, "set_launch_sm_count: a negative SM count (" + std::to_string(sms) +
                                                   "); 0 restores the device's own");
  if (sms != 0) check_count(device, sms);
  detail::launch_sm_override(device).store(sms, std::memory_order_release);
}

}  // namespace difuse::probe
