// Settings a mode ignores: refused or warned about when the runtime is attached (Note [Settings a mode
// ignores] in config.hpp).
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/core/config.hpp"
#include "config_rows.hpp"

namespace tierflow {

using config_detail::keyword_of;
namespace {

// One setting a mode ignores (Note [Settings a mode ignores]).
struct Ignored {
  std::string_view setting;  // the ignored setting, e.g. TIERFLOW_MAX_GRAD_NORM
  std::string_view chooser;  // the setting that chose the mode, e.g. TIERFLOW_OFFLOAD_OPTIMIZER
  std::string_view why;      // what that mode does instead
  std::string_view accepted;  // what would make the setting act
  bool refuse;               // ignoring it changes results or breaks a promise about memory
};

}  // namespace

IgnoredSettings ignored_settings(const Config& config, const ModelFacts& model) {
  const auto now = config.to_strings();
  const auto defaults = Config::defaults().to_strings();
  std::vector<Ignored> rules;
  constexpr std::string_view kOptimizer = "TIERFLOW_OFFLOAD_OPTIMIZER";
  constexpr std::string_view kCpuOptimizer = "TIERFLOW_OFFLOAD_OPTIMIZER=host or nvme (tierflow's CPU optimizer)";
  const bool no_cpu_optimizer = config.offload_optimizer == OffloadTarget::kNone;
  if (no_cpu_optimizer) {
    constexpr std::string_view kWhy = "none leaves your optimizer as it is, and this setting acts on tierflow's CPU "
                                      "optimizer only";
    rules.push_back({"TIERFLOW_MAX_GRAD_NORM", kOptimizer, kWhy,
                     "TIERFLOW_OFFLOAD_OPTIMIZER=host or nvme (tierflow's CPU optimizer); with your own optimizer, "
                     "clip with torch.nn.utils.clip_grad_norm_", true});
    rules.push_back({"TIERFLOW_SKIP_NONFINITE", kOptimizer, kWhy,
                     "TIERFLOW_OFFLOAD_OPTIMIZER=host or nvme (tierflow's CPU optimizer); with your own optimizer, "
                     "skip non-finite steps with torch.amp.GradScaler", true});
    rules.push_back({"TIERFLOW_OFFLOAD_GRADIENTS", kOptimizer,
                     "none copies no gradient to the host, so every gradient stays on the device until zero_grad",
                     kCpuOptimizer, true});
    rules.push_back({"TIERFLOW_PARTITION_OPTIMIZER", kOptimizer,
                     "none leaves your optimizer as it is, and every rank keeps every parameter's states",
                     kCpuOptimizer, true});
    for (std::string_view speed : {"TIERFLOW_OVERLAP_STEP", "TIERFLOW_GRAD_BUCKET_BYTES", "TIERFLOW_WEIGHTS_RETURN",
                                   "TIERFLOW_GRAD_ACCUMULATION_STEPS", "TIERFLOW_GPU_OPTIMIZER_FRACTION",
                                   "TIERFLOW_CPU_THREADS", "TIERFLOW_CPU_ISA", "TIERFLOW_OPTIMIZER_STATES"})
      rules.push_back({speed, kOptimizer, "none leaves your optimizer as it is, and this setting tunes tierflow's "
                                          "CPU optimizer only", kCpuOptimizer, false});
  } else {
    if (config.offload_optimizer == OffloadTarget::kNvme || !config.overlap_step) {
      const bool nvme = config.offload_optimizer == OffloadTarget::kNvme;
      const std::string_view chooser = nvme ? kOptimizer : "TIERFLOW_OVERLAP_STEP";
      const std::string_view why = nvme ? "states on NVMe step in step(), with no gradient stream during backward"
                                        : "off steps every parameter in step(), with no gradient stream during "
                                          "backward";
      for (std::string_view speed :
           {"TIERFLOW_GRAD_BUCKET_BYTES", "TIERFLOW_WEIGHTS_RETURN", "TIERFLOW_GRAD_ACCUMULATION_STEPS"})
        rules.push_back({speed, chooser, why, "TIERFLOW_OFFLOAD_OPTIMIZER=host with TIERFLOW_OVERLAP_STEP=on",
                         false});
      if (nvme)
        rules.push_back({"TIERFLOW_OVERLAP_STEP", kOptimizer, why, "TIERFLOW_OFFLOAD_OPTIMIZER=host", false});
    }
    if (!model.cuda)
      rules.push_back({"TIERFLOW_GPU_OPTIMIZER_FRACTION", "TIERFLOW_DEVICE",
                       "the model is not on a CUDA GPU, so every optimizer state steps on the CPU",
                       "a model on a CUDA GPU", false});
  }
  if (config.nvme_paths.empty())
    for (std::string_view setting : {"TIERFLOW_NVME_MEMORY", "TIERFLOW_AIO_BLOCK_SIZE", "TIERFLOW_AIO_QUEUE_DEPTH",
                                     "TIERFLOW_NVME_CHECKSUM"})
      rules.push_back({setting, "TIERFLOW_NVME_PATHS", "no path means no NVMe tier",
                       "TIERFLOW_NVME_PATHS set to the directories of the NVMe tier", false});
  const auto acts = config.offload_activations;
  const bool fixed = acts != OffloadTarget::kAuto;
  if (fixed)  // recompute's plan is forced: nothing measured, read, written or re-planned
    for (std::string_view setting : {"TIERFLOW_PROFILE", "TIERFLOW_REPLAN"})
      rules.push_back({setting, "TIERFLOW_OFFLOAD_ACTIVATIONS", "there is no activation planner in this mode",
                       "TIERFLOW_OFFLOAD_ACTIVATIONS=auto", false});
  if (acts == OffloadTarget::kNone)
    for (std::string_view setting : {"TIERFLOW_MIN_OFFLOAD_BYTES", "TIERFLOW_PREFETCH_BYTES"})
      rules.push_back({setting, "TIERFLOW_OFFLOAD_ACTIVATIONS", "none keeps every saved tensor on the device",
                       "TIERFLOW_OFFLOAD_ACTIVATIONS=host, nvme, recompute or auto", false});
  // The device budget is read by the activation planner, the parameters' residency and the GPU share's choice;
  // a fixed activation mode with the parameters on the device and no GPU share to size plans by nothing.
  const bool gpu_share_reads_budget = !no_cpu_optimizer && model.cuda && config.gpu_optimizer_fraction_auto;
  if (fixed && config.offload_params == OffloadTarget::kNone && !gpu_share_reads_budget)
    rules.push_back({"TIERFLOW_GPU_MEMORY", "TIERFLOW_OFFLOAD_ACTIVATIONS",
                     "a fixed activation mode does not plan by the device budget, and nothing keeps the run within "
                     "it", "TIERFLOW_OFFLOAD_ACTIVATIONS=auto (or TIERFLOW_OFFLOAD_PARAMS=host, nvme or auto)", false});
  // Nothing goes to the host: no pinned pool to budget or to allocate in slabs.
  if (acts == OffloadTarget::kNone && config.offload_params == OffloadTarget::kNone && no_cpu_optimizer)
    for (std::string_view setting : {"TIERFLOW_HOST_MEMORY", "TIERFLOW_PINNED_SLAB_BYTES"})
      rules.push_back({setting, "TIERFLOW_OFFLOAD_ACTIVATIONS",
                       "with TIERFLOW_OFFLOAD_PARAMS=none and TIERFLOW_OFFLOAD_OPTIMIZER=none too, nothing goes to "
                       "the pinned host pool",
                       "TIERFLOW_OFFLOAD_ACTIVATIONS, TIERFLOW_OFFLOAD_PARAMS or TIERFLOW_OFFLOAD_OPTIMIZER other than "
                       "none", false});

  IgnoredSettings out;
  std::set<std::string> said;  // one line per setting, the first rule's
  for (const auto& rule : rules) {
    const std::string key(rule.setting);
    if (config.given.count(key) == 0 || now.at(key) == defaults.at(key) || !said.insert(key).second) continue;
    const std::string chooser(rule.chooser);
    const std::string chosen = chooser == "TIERFLOW_NVME_PATHS" ? "(empty)" : now.at(chooser);
    std::string line = key + "=" + quote_config_value(now.at(key)) + " (keyword " + keyword_of(rule.setting) +
                       ") is ignored with " + chooser + "=" + chosen + " (keyword " + keyword_of(rule.chooser) +
                       "): " + std::string(rule.why);
    if (rule.refuse) {
      if (out.refusal.empty())
        out.refusal = line + "; accepted: " + std::string(rule.accepted) + ", or leave " + key +
                      " unset (its default is " + quote_config_value(defaults.at(key)) + ")";
    } else {
      out.warnings.push_back(line + "; it has no effect in this run (it would act with " +
                             std::string(rule.accepted) + ")");
    }
  }
  return out;
}

}  // namespace tierflow
