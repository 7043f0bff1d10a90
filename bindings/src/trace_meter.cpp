// See trace_meter.hpp and Note [Trace].
#include "tierflow/bindings/trace_meter.hpp"

#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/trace.hpp"

namespace tierflow::bindings {

void attach_trace(Runtime& runtime) {
  // Raw pointers: trace::detach, in ~Runtime before its members go, waits for a meter that runs.
  allocator::PinnedHostPool* pool = runtime.host_pool().get();
  ActivationOffloader* activations = runtime.activations().get();
  swap::NvmeEngine* nvme = runtime.nvme_engine().get();
  trace::attach(&runtime, runtime.config().trace_path, [pool, activations, nvme] {
    std::vector<std::pair<std::string, std::int64_t>> v;
    v.emplace_back("device activations", activations ? activations->stats().device_bytes.current : 0);
    v.emplace_back("pinned host", pool ? pool->stats().in_use.current : 0);
    v.emplace_back("NVMe", nvme ? static_cast<std::int64_t>(nvme->stats().bytes_in_use) : 0);
    return v;
  });
}

}  // namespace tierflow::bindings
