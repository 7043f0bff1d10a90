// See Note [Wrap refusals] in wrap_checks.hpp.
#include "tierflow/tiering/wrap_checks.hpp"

#include "tierflow/core/size.hpp"

namespace tierflow::tiering {
namespace {

// A shape as Python writes list(t.shape): "[4, 8]".
std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

}  // namespace

std::string device_budget_refusal(const Config& settings, std::uint64_t budget_bytes, DeviceParamBytes params) {
  if (settings.offload_params != OffloadTarget::kNone) return "";
  const std::uint64_t grads = settings.offload_gradients ? 0 : params.trainable;
  const std::uint64_t total = params.weights + grads;
  if (total <= budget_bytes) return "";
  const std::string mode(to_string(settings.offload_activations));
  const std::string why = settings.offload_activations == OffloadTarget::kAuto
                              ? "no activation plan can fit"
                              : "TIERFLOW_OFFLOAD_ACTIVATIONS=" + mode +
                                    " (keyword offload_activations) cannot keep the run within it";
  return "TIERFLOW_GPU_MEMORY=" + settings.gpu_memory.to_string() + " (keyword gpu_memory) gives the device " +
         format_bytes(budget_bytes) + ", less than the model's parameters and their gradients take on it (" +
         format_bytes(total) + ": " + format_bytes(params.weights) + " of parameters), so " + why +
         "; accepted: a budget above " + format_bytes(total) + " with room for the activations, or "
         "TIERFLOW_OFFLOAD_PARAMS=host (keyword offload_params) to keep the parameters off the device";
}

std::string meta_refusal(std::size_t count, const std::string& first_name, const std::vector<std::int64_t>& first_shape) {
  return std::to_string(count) + " of the model's parameters and buffers are on the meta device (the first: " +
         first_name + " " + shape_text(first_shape) +
         "): they have shapes but no values to train; accepted: a model whose tensors hold values on the CPU or a "
         "GPU (materialize it first, e.g. model.to_empty(device='cpu') then load its weights, or build it outside "
         "torch.device('meta'))";
}

std::string foreign_parameters_refusal(std::size_t foreign, std::size_t held, const std::vector<std::int64_t>& first_shape) {
  return std::to_string(foreign) + " of the optimizer's " + std::to_string(held) +
         " parameters are not parameters of the model being wrapped (the first has shape " + shape_text(first_shape) +
         "), so training this model would not update them, or the optimizer would not update this model; build the "
         "optimizer from this model's parameters (torch.optim.AdamW(model.parameters())), or wrap a module that "
         "holds every parameter the optimizer steps. An optimizer over part of the model (frozen layers, a second "
         "optimizer) is fine";
}

std::string wrapper_refusal(const std::string& wrapper, const std::string& optimizer, const std::string& attribute) {
  return "the optimizer wrapper " + wrapper + " keeps its own reference to the " + optimizer + " it wraps (attribute " +
         attribute + "), so it cannot be pointed at tierflow's CPU optimizer; call tierflow.wrap(model, optimizer) "
         "first on the plain optimizer, then wrap what it returns (e.g. accelerator.prepare(model, optimizer) after "
         "tierflow.wrap), or pass offload_optimizer='none' to keep your optimizer";
}

std::string deepcopy_refusal() {
  return "copy.deepcopy of a model tierflow.wrap wrapped: its hooks would drive the original's runtime (and "
         "offloaded parameters would be copied without their values). Deep-copy the model before tierflow.wrap "
         "(a reference model, an EMA copy), or call tierflow.unwrap(model) first and wrap both after";
}

}  // namespace tierflow::tiering
