// cpp_trainer: a pure LibTorch trainer embedding tierflow. It trains the same
// small GPT twice from the same seed, on the same batches: first plain LibTorch
// with torch::optim::AdamW, then with tierflow's per-block activation offload
// (Note [C++ block offload]) and its CPU AdamW (Note [C++ CpuAdamW]), prints
// both loss series and exits non-zero when they differ by more than the
// tolerance.
//
//   cpp_trainer [--activations config|keep|host|nvme|recompute|auto] [--optimizer tierflow|torch]
//               [--params device|host] [--steps N] [--tolerance X]
//
// --params host keeps the blocks' parameters on the host between uses
// (Note [C++ parameter residency]): fetched before each block runs and
// released after, stepped on the host by the CPU AdamW (during backward, its
// committed weights written into the host copies), so the device holds about
// two blocks' weights at a time.
//
// The CPU AdamW steps during backward with TIERFLOW_OVERLAP_STEP=on, the
// default (Note [C++ steps during backward]): the run then prints
// `stepped during backward N (committed C, redone R, ...)` and fails when
// nothing was.
//
// --activations picks every block's action; `config` (the default) takes it
// from TIERFLOW_OFFLOAD_ACTIVATIONS. `auto` (with TIERFLOW_OFFLOAD_ACTIVATIONS=auto)
// sets none: tiering::PlanDriver plans them (Note [C++ auto activations]),
// every block swapped in the first two steps and the plan in force from the
// third; the run prints `tierflow activation plan: ...` and fails without one.
// --optimizer torch keeps torch::optim::AdamW
// in the tierflow run, so only the activation offload differs: the losses
// must then be bit-identical (--tolerance 0). Every other setting comes from the
// TIERFLOW_* variables (tierflow::Config::from_environment()), e.g.
// TIERFLOW_OFFLOAD_OPTIMIZER=nvme TIERFLOW_NVME_PATHS=/mnt/nvme for NVMe states.
//
// Tolerance: the activation offload and the recompute are exact (same RNG
// state, same kernels). The only difference is the optimizer's rounding:
// tierflow's kernel follows torch's Python AdamW, LibTorch's C++ AdamW rounds
// a few operations differently, a few ulp per parameter and step, which over
// ten steps of this model moves the loss by ~1e-7. 1e-5 leaves a wide margin
// and still catches any real error (a wrong mask or a stale input moves it by
// 1e-2 or more).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <tierflow/bindings/block_offload.hpp>
#include <tierflow/bindings/cpu_adamw.hpp>
#include <tierflow/bindings/runtime.hpp>
#include <tierflow/core/config.hpp>

#include "gpt.hpp"

namespace tb = tierflow::bindings;

namespace {

struct Args {
  std::string activations = "config";
  std::string optimizer = "tierflow";
  std::string params = "device";
  int steps = 10;
  double tolerance = 1e-5;
};

struct Result {
  std::vector<double> losses;
  double step_ms = 0;  // mean after the first step
  std::vector<torch::Tensor> exp_avgs;  // the optimizer's first moments after training, per parameter
};

constexpr uint64_t kSeed = 1234;
constexpr int64_t kBatch = 8;
const torch::optim::AdamWOptions kAdamW = torch::optim::AdamWOptions(3e-3).weight_decay(0.1);

// Rows of an arithmetic pattern mod the vocabulary with random start and
// stride: learnable, so the loss falls and the comparison means something.
std::vector<torch::Tensor> make_batches(const GPTConfig& c, int steps, torch::Device device) {
  torch::manual_seed(kSeed + 1);
  std::vector<torch::Tensor> batches;
  for (int s = 0; s < steps; ++s) {
    auto start = torch::randint(c.vocab, {kBatch, 1}, torch::kLong);
    auto stride = torch::randint(1, 4, {kBatch, 1}, torch::kLong);
    auto rows = (start + stride * torch::arange(c.seq + 1, torch::kLong)) % c.vocab;
    batches.push_back(rows.to(device));
  }
  return batches;
}

Result train(GPT& model, torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& batches, const GPTConfig& c,
             tb::BlockOffload* offload) {
  Result r;
  double total_ms = 0;
  for (std::size_t s = 0; s < batches.size(); ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    auto x = batches[s].slice(1, 0, c.seq), y = batches[s].slice(1, 1, c.seq + 1);
    auto logits = model->forward(x, offload);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, c.vocab}), y.reshape({-1}));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    r.losses.push_back(loss.item<double>());
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) total_ms += ms;
  }
  r.step_ms = batches.size() > 1 ? total_ms / static_cast<double>(batches.size() - 1) : 0;
  return r;
}

// The first moments as torch::optim::AdamW would hold them: the optimizer is
// saved and loaded into a torch::optim::AdamW, which also checks that the
// archive layouts agree.
std::vector<torch::Tensor> exp_avgs_via_torch(const torch::optim::Optimizer& saved, GPT& model) {
  torch::serialize::OutputArchive out;
  saved.save(out);
  std::stringstream buffer;
  out.save_to(buffer);
  torch::optim::AdamW loaded(model->parameters(), kAdamW);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  loaded.load(in);
  std::vector<torch::Tensor> result;
  for (const auto& p : model->parameters()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*loaded.state().at(p.unsafeGetTensorImpl()));
    result.push_back(st.exp_avg().to(torch::kCPU));
  }
  return result;
}

tb::BlockAction parse_action(const std::string& name, const tierflow::Config& config) {
  if (name == "config") return tb::block_action_from_config(config);
  if (name == "keep") return tb::BlockAction::kKeep;
  if (name == "host") return tb::BlockAction::kSwapHost;
  if (name == "nvme") return tb::BlockAction::kSwapNvme;
  if (name == "recompute") return tb::BlockAction::kRecompute;
  if (name == "auto") {
    if (config.offload_activations != tierflow::OffloadTarget::kAuto) {
      std::fprintf(stderr, "cpp_trainer: --activations auto needs TIERFLOW_OFFLOAD_ACTIVATIONS=auto (the plan driver "
                           "runs under it); accepted with another value: config, keep, host, nvme, recompute\n");
      std::exit(2);
    }
    return tb::BlockAction::kSwapHost;  // the profiling steps' action; the plan's from the third step
  }
  std::fprintf(stderr, "cpp_trainer: --activations '%s'; accepted: config, keep, host, nvme, recompute, auto\n",
               name.c_str());
  std::exit(2);
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--activations" && has_value) a.activations = argv[++i];
    else if (arg == "--optimizer" && has_value && (std::strcmp(argv[i + 1], "tierflow") == 0 ||
                                                   std::strcmp(argv[i + 1], "torch") == 0))
      a.optimizer = argv[++i];
    else if (arg == "--params" && has_value && (std::strcmp(argv[i + 1], "device") == 0 ||
                                                std::strcmp(argv[i + 1], "host") == 0))
      a.params = argv[++i];
    else if (arg == "--steps" && has_value) a.steps = std::atoi(argv[++i]);
    else if (arg == "--tolerance" && has_value) a.tolerance = std::atof(argv[++i]);
    else {
      std::fprintf(stderr, "usage: cpp_trainer [--activations config|keep|host|nvme|recompute|auto] "
                           "[--optimizer tierflow|torch] [--params device|host] [--steps N] [--tolerance X]\n");
      std::exit(2);
    }
  }
  return a;
}

// What the tierflow run used and saw, for the report and the checks.
struct Tierflow {
  std::shared_ptr<tb::Runtime> runtime;
  std::unique_ptr<tb::BlockOffload> offload;
  tb::BlockAction action = tb::BlockAction::kKeep;
  std::unique_ptr<torch::optim::Optimizer> opt;
  const tb::CpuAdamW* cpu_adamw = nullptr;  // null with --optimizer torch
};

// The same model with tierflow: the runtime from the TIERFLOW_* variables, one action per block, the blocks'
// parameters on the host (--params host), the CPU AdamW (steps during backward with TIERFLOW_OVERLAP_STEP=on,
// Note [C++ steps during backward]) or torch's.
Result train_with_tierflow(const Args& args, const GPTConfig& c, const std::vector<torch::Tensor>& batches,
                           torch::Device device, Tierflow& tf) {
  tf.runtime = std::make_shared<tb::Runtime>(tierflow::Config::from_environment());
  tf.offload = std::make_unique<tb::BlockOffload>(tf.runtime);
  tf.action = parse_action(args.activations, tf.runtime->config());
  if (args.activations != "auto")  // auto: the plan driver's (Note [C++ auto activations])
    tf.offload->set_actions(std::vector<tb::BlockAction>(static_cast<std::size_t>(c.layers), tf.action));
  torch::manual_seed(kSeed);
  GPT model(c);
  model->to(device);
  tf.offload->set_model_parameters(model->parameters());  // auto's device budget counts them all
  if (args.params == "host") {
    if (device.is_cuda() && args.optimizer == "torch") {
      std::fprintf(stderr, "cpp_trainer: --params host with --optimizer torch on CUDA: torch's AdamW would step host "
                           "weights with device gradients; accepted with --params host on CUDA: --optimizer tierflow\n");
      std::exit(2);
    }
    std::vector<std::vector<torch::Tensor>> block_params;
    for (const auto& b : model->blocks) block_params.push_back(b->parameters());
    tf.offload->offload_parameters(block_params);  // before the optimizer: it steps them where they live
  }
  if (args.optimizer == "torch") {
    tf.opt = std::make_unique<torch::optim::AdamW>(model->parameters(), kAdamW);
  } else {
    auto opt = std::make_unique<tb::CpuAdamW>(tf.runtime, model->parameters(), kAdamW);
    opt->use_host_copies(*tf.offload);  // committed weights of host-resident parameters go to their host copies
    tf.cpu_adamw = opt.get();
    tf.opt = std::move(opt);
  }
  Result r = train(model, *tf.opt, batches, c, tf.offload.get());
  tf.offload->synchronize();
  r.exp_avgs = exp_avgs_via_torch(*tf.opt, model);
  return r;
}

std::string optimizer_name(const Tierflow& tf) {
  if (!tf.cpu_adamw) return "torch::optim::AdamW";
  if (tf.cpu_adamw->states_on_nvme()) return "tierflow CpuAdamW, states on nvme";
  return tf.cpu_adamw->steps_during_backward() ? "tierflow CpuAdamW, states on host, steps during backward"
                                               : "tierflow CpuAdamW, states on host";
}

// Prints the tierflow run's counters.
void print_counters(const Args& args, const Tierflow& tf) {
  const auto st = tf.offload->stats();
  const auto host = tf.offload->host_stats();
  const auto nvme = tf.offload->nvme_stats();
  std::printf("blocks: swapped to host %llu, to nvme %llu, recomputed-only %llu, kept %llu; reruns %llu (%.1f ms)\n",
              (unsigned long long)st.swapped_host, (unsigned long long)st.swapped_nvme,
              (unsigned long long)st.recomputed, (unsigned long long)st.kept, (unsigned long long)st.reruns,
              static_cast<double>(st.rerun_ns) / 1e6);
  std::printf("host tier: %llu inputs offloaded (%llu bytes), prefetch hits %llu, stalls %llu; "
              "nvme tier: %llu writes (%llu bytes), %llu reads\n",
              (unsigned long long)host.offloaded_blocks, (unsigned long long)host.offloaded_bytes,
              (unsigned long long)(host.prefetch_hits + nvme.prefetch_hits),
              (unsigned long long)(host.stalls + nvme.stalls), (unsigned long long)nvme.nvme_writes,
              (unsigned long long)nvme.nvme_write_bytes, (unsigned long long)nvme.nvme_reads);
  const auto ps = tf.offload->parameter_stats();
  if (args.params == "host")
    std::printf("parameters: on the host between uses; %llu fetches (%llu bytes host->device), prefetch hits %llu, "
                "stalls %llu; on the device at most %llu bytes, %llu bytes on the host\n",
                (unsigned long long)ps.fetches, (unsigned long long)ps.host_to_device_bytes,
                (unsigned long long)ps.prefetch_hits, (unsigned long long)ps.stalls,
                (unsigned long long)ps.device_peak_bytes, (unsigned long long)ps.host_bytes);
  if (tf.cpu_adamw && tf.cpu_adamw->steps_during_backward()) {
    const tb::GradStreamStats ss = tf.cpu_adamw->stream_stats();
    std::printf("optimizer: %s; %llu gradient buckets of %llu bytes, %llu weight bytes into host copies\n",
                tb::describe_steps_during_backward(ss).c_str(), (unsigned long long)ss.buckets,
                (unsigned long long)ss.bucket_bytes, (unsigned long long)ss.weight_bytes_to_host_copy);
  }
}

// Why the run did not go through the path it names (it then proves nothing), or "".
std::string not_exercised(const Args& args, const Tierflow& tf, torch::Device device) {
  const auto st = tf.offload->stats();
  const bool on_runtime_device = tf.runtime->on_device(torch::empty({1}, torch::device(device)));
  const auto what = std::string(tb::to_string(tf.action));
  if (args.activations == "auto" && tf.offload->activation_plan().empty())
    return "auto made no activation plan by the third step";
  if (on_runtime_device && tf.action == tb::BlockAction::kSwapHost && tf.offload->host_stats().offloaded_blocks == 0)
    return "the " + what + " plan swapped nothing";
  if (on_runtime_device && tf.action == tb::BlockAction::kSwapNvme && tf.offload->nvme_stats().nvme_writes == 0)
    return "the " + what + " plan wrote nothing to NVMe";
  if (tf.action != tb::BlockAction::kKeep && st.reruns == 0) return "the " + what + " plan reran nothing";
  const auto ps = tf.offload->parameter_stats();
  if (args.params == "host" && !(ps.fetches > 0 && ps.device_peak_bytes < ps.host_bytes))
    return "--params host fetched nothing, or held every block's weights at once";
  if (tf.cpu_adamw && tf.cpu_adamw->steps_during_backward()) {
    const tb::GradStreamStats ss = tf.cpu_adamw->stream_stats();
    if (ss.early_steps == 0 || ss.committed == 0) return "nothing stepped during backward and was committed";
    if (args.params == "host" && ss.weight_bytes_to_host_copy == 0)
      return "no committed weight went into a host copy";
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  const torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  const GPTConfig c;
  const auto batches = make_batches(c, args.steps, device);

  // 1. Plain LibTorch.
  torch::manual_seed(kSeed);
  GPT baseline_model(c);
  baseline_model->to(device);
  torch::optim::AdamW baseline_opt(baseline_model->parameters(), kAdamW);
  Result baseline = train(baseline_model, baseline_opt, batches, c, nullptr);
  baseline.exp_avgs = exp_avgs_via_torch(baseline_opt, baseline_model);

  // 2. The same with tierflow.
  Tierflow tf;
  const Result ours = train_with_tierflow(args, c, batches, device, tf);

  std::printf("cpp_trainer: device %s (tierflow runtime: %s%s), %lld blocks: %s, optimizer %s\n",
              device.str().c_str(), std::string(tierflow::allocator::to_string(tf.runtime->device_kind())).c_str(),
              tf.runtime->adversarial() ? ", adversarial" : "", static_cast<long long>(c.layers),
              std::string(tb::to_string(tf.action)).c_str(), optimizer_name(tf).c_str());
  std::printf("%6s %14s %14s %10s\n", "step", "libtorch", "tierflow", "|diff|");
  double max_diff = 0;
  for (std::size_t s = 0; s < baseline.losses.size(); ++s) {
    const double d = std::abs(baseline.losses[s] - ours.losses[s]);
    max_diff = std::max(max_diff, d);
    std::printf("%6zu %14.8f %14.8f %10.2e\n", s, baseline.losses[s], ours.losses[s], d);
  }
  double exp_avg_diff = 0, exp_avg_max = 0;
  for (std::size_t i = 0; i < baseline.exp_avgs.size(); ++i) {
    exp_avg_diff = std::max(exp_avg_diff, (baseline.exp_avgs[i] - ours.exp_avgs[i]).abs().max().item<double>());
    exp_avg_max = std::max(exp_avg_max, baseline.exp_avgs[i].abs().max().item<double>());
  }
  std::printf("step time (mean after the first): libtorch %.1f ms, tierflow %.1f ms\n", baseline.step_ms, ours.step_ms);
  if (args.activations == "auto") {
    std::printf("tierflow activation plan: %s\n", tf.offload->activation_plan().c_str());
    for (const auto& line : tf.offload->activation_plan_lines()) std::printf("  %s\n", line.c_str());
  }
  print_counters(args, tf);
  std::printf("optimizer: saved and loaded into torch::optim::AdamW, max |exp_avg diff| = %.2e (max |exp_avg| %.2e)\n",
              exp_avg_diff, exp_avg_max);
  std::printf("cpp_trainer: max |loss diff| = %.3e over %zu steps\n", max_diff, baseline.losses.size());

  if (const std::string why = not_exercised(args, tf, device); !why.empty()) {
    std::fprintf(stderr, "cpp_trainer: FAILED: %s\n", why.c_str());
    return 1;
  }
  if (!(max_diff <= args.tolerance)) {
    std::fprintf(stderr, "cpp_trainer: FAILED: loss difference %.3e exceeds the tolerance %.1e\n", max_diff,
                 args.tolerance);
    return 1;
  }
  if (!(exp_avg_diff <= 1e-3 * exp_avg_max)) {
    std::fprintf(stderr, "cpp_trainer: FAILED: the optimizer states differ from torch's (%.2e)\n", exp_avg_diff);
    return 1;
  }
  return 0;
}
