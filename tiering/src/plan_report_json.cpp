// `python -m tierflow plan --json`: the JSON document of Note [Plan report].
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "tierflow/tiering/detail/plan_report_parts.hpp"
#include "tierflow/tiering/step_prediction.hpp"

namespace tierflow::tiering::detail {
namespace {

using Json = nlohmann::ordered_json;  // keys in the order written (Note [Plan report])

Json alternatives_json(const Plan& plan, const BlockWhy& why) {
  Json items = Json::array();
  for (const auto& a : why.rejected) {
    items.push_back({{"mode", to_string(a.block.mode)},
                     {"alpha", a.block.alpha},
                     {"swap_tier", to_string(a.block.tier)},
                     {"swap_bytes", a.block.swap_bytes},
                     {"step_seconds", a.step_seconds},
                     {"gpu_peak_bytes", a.device_peak_bytes},
                     {"host_bytes", a.host_bytes},
                     {"nvme_bytes", a.nvme_bytes},
                     {"fits", a.fits()},
                     {"why", why_rejected(a, plan)}});
  }
  return items;
}

Json fixed_json(const std::vector<FixedPart>& parts) {
  Json items = Json::array();
  for (const auto& p : parts)
    items.push_back({{"part", p.name}, {"gpu_bytes", p.bytes},
                     {"freed_by", p.freed_by.empty() ? Json(nullptr) : Json(p.freed_by)}});
  return items;
}

Json params_json(const Plan& plan, const PlanCommandInputs& in, const Budgets& budgets) {
  std::size_t fetched = 0;
  for (const auto& b : plan.blocks) fetched += b.params != Tier::kGpu;
  return {{"offload", in.offload_params},
          {"policy", to_string(budgets.params)},
          {"fetched_blocks", fetched},
          {"rest", to_string(plan.rest_params)},
          {"rest_bytes", budgets.rest_parameter_bytes},
          {"gpu_resident_bytes", plan.device_param_bytes},
          {"gpu_window_bytes", plan.param_window_bytes},
          {"prefetch_bytes", plan.param_prefetch_bytes},
          {"host_bytes", plan.host_param_bytes},
          {"nvme_bytes", plan.nvme_param_bytes},
          {"rest_fetch_seconds", plan.rest_fetch_seconds}};
}

// The "step" object of the JSON: each term's seconds, then the optimizer's parts.
Json step_json(const StepPrediction& step, const OptimizerStepInputs& o) {
  Json terms = Json::object();
  for (const auto& [name, seconds] : step_terms(step)) terms[name] = seconds;
  const auto& t = step.optimizer;
  return {{"terms_seconds", std::move(terms)},
          {"blocks_seconds", step.blocks_seconds},
          {"backward_seconds", step.backward_seconds},
          {"optimizer", {{"on_cpu", o.on_cpu},
                         {"parameters", o.parameters},
                         {"params_per_second", o.params_per_second > 0 ? Json(o.params_per_second) : Json(nullptr)},
                         {"states", to_string(o.states)},
                         {"steps_during_backward", o.steps_during_backward},
                         {"kernel_seconds", t.kernel_seconds},
                         {"nvme_state_bytes", o.nvme_state_bytes},
                         {"nvme_read_seconds", t.nvme_read_seconds},
                         {"nvme_write_seconds", t.nvme_write_seconds},
                         {"busy_seconds", t.busy_seconds},
                         {"exposed_seconds", t.exposed_seconds}}}};
}

}  // namespace

// Today's keys, then the issue-17 ones.
std::string plan_json(const Plan& plan, const PlanCommandInputs& in, const PlanCommandBudgets& pb,
                      const std::vector<BlockWhy>& why, const std::vector<FixedPart>& parts,
                      const StepPrediction& step, const OptimizerStepInputs& optimizer) {
  const Budgets& budgets = pb.budgets;
  const Links& links = pb.links;
  const bool has_flops = in.flops_per_second && *in.flops_per_second != 0;
  Json layers = Json::array();
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    const auto& b = plan.blocks[i];
    layers.push_back({{"mode", to_string(b.mode)},
                      {"alpha", b.alpha},
                      {"keep", b.keep},
                      {"swap", b.swap},
                      {"recompute", b.recompute},
                      {"swap_tier", to_string(b.tier)},
                      {"swap_bytes", b.swap_bytes},
                      {"forward_seconds", b.forward_seconds},
                      {"backward_seconds", b.backward_seconds},
                      {"params", to_string(b.params)},
                      {"alternatives", alternatives_json(plan, why[i])}});
  }
  Json doc;
  doc["layers"] = std::move(layers);
  doc["predicted"] = {{"gpu_peak_bytes", plan.predicted_device_peak_bytes},
                      {"step_seconds", plan.predicted_step_seconds},
                      {"keep_all_step_seconds", plan.keep_all_step_seconds},
                      {"host_bytes", plan.host_bytes},
                      {"nvme_bytes", plan.nvme_bytes},
                      {"proven_optimal", plan.proven_optimal},
                      {"outside_kept", plan.outside_kept},
                      {"outside_tier", std::string(to_string(plan.outside_tier))},
                      {"outside_bytes", plan.outside_bytes},
                      {"outside_swap_seconds", plan.outside_swap_seconds},
                      {"outside_staging_bytes", plan.outside_staging_bytes}};
  doc["budgets"] = {{"gpu_bytes", budgets.device_bytes},
                    {"fixed_gpu_bytes", budgets.fixed_device_bytes},
                    {"host_bytes_for_activations", budgets.host_bytes},
                    {"nvme_bytes", budgets.nvme_bytes},
                    {"prefetch_bytes", budgets.prefetch_bytes},
                    {"outside_largest_bytes", budgets.outside_largest_bytes}};
  doc["links"] = {{"d2h", links.d2h}, {"h2d", links.h2d}, {"duplex", links.duplex},
                  {"nvme_write", links.nvme_write}, {"nvme_read", links.nvme_read}};
  doc["tflops"] = has_flops ? Json(*in.flops_per_second / 1e12) : Json(nullptr);
  doc["measured"] = in.measured;
  doc["summary"] = plan.summary();
  if (in.state) {
    doc["state"] = {{"optimizer", in.optimizer},
                    {"optimizer_states", to_string(in.optimizer_states)},
                    {"gpu_bytes", in.state->device},
                    {"host_bytes", in.state->host},
                    {"nvme_bytes", in.state->nvme},
                    {"outside_blocks_gpu_bytes", in.head_bytes},
                    {"offload_gradients", in.offload_gradients},
                    // What the CPU AdamW asks of the pinned pool (optimizer_pinned_bytes: state_pool_need).
                    {"pinned_host_bytes", pb.optimizer_host_bytes}};
  }
  doc["fixed_gpu_parts"] = fixed_json(parts);
  doc["parameters"] = params_json(plan, in, budgets);
  doc["step"] = step_json(step, optimizer);
  // Names and lines are ASCII; a --profile path of other bytes is escaped, never an error.
  return doc.dump(-1, ' ', true, Json::error_handler_t::replace);
}

}  // namespace tierflow::tiering::detail
