// The configuration table's rows: every TIERFLOW_* variable's entry and the parser that stores its value
// into Config (Note [One configuration table]); config.cpp reads the environment and parses with them.
#include "config_rows.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>

#include <sys/stat.h>
#include <unistd.h>

#include "tierflow/core/stall.hpp"
#include "tierflow/core/error.hpp"

namespace tierflow::config_detail {

// `reason`, when given, says why a value of an accepted-looking form is refused ("it is a directory").
[[noreturn]] void bad_value(std::string_view name, std::string_view value, std::string_view accepted,
                            std::string_view reason) {
  throw config_error(std::string(name) + "=" + quote_config_value(value) + " is not valid" +
                     (reason.empty() ? "" : " (" + std::string(reason) + ")") + "; accepted: " +
                     std::string(accepted));
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string trim(std::string_view s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string keyword_of(std::string_view name) { return lower(name.substr(kPrefix.size())); }

namespace {

constexpr std::string_view kBudgetForms =
    "a size (e.g. 512MiB, 1.5GiB, 4096; units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB) or a "
    "percentage of the tier's capacity in (0%, 100%], e.g. 80%";

// `nonzero`: a budget of 0 bytes leaves the tier nothing to use, a mistake to refuse here rather than at
// the first allocation.
auto budget_parser(Budget Config::*field, bool nonzero = false) {
  return [field, nonzero](Config& c, std::string_view name, std::string_view v) {
    auto b = parse_budget(v);
    if (!b) bad_value(name, v, kBudgetForms);
    if (nonzero && !b->is_fraction && b->bytes == 0)
      bad_value(name, v, kBudgetForms, "a budget of 0 bytes leaves nothing to use");
    c.*field = *b;
  };
}

// A decimal integer in [lo, hi] (no sign, exponent or hex).
auto int_parser(int Config::*field, int lo, int hi, std::string_view accepted) {
  return [=](Config& c, std::string_view name, std::string_view v) {
    auto n = parse_uint(v, static_cast<std::uint64_t>(hi));
    if (!n || *n < static_cast<std::uint64_t>(lo)) bad_value(name, v, accepted);
    c.*field = static_cast<int>(*n);
  };
}

// A file that tierflow reads or writes later: a directory there would fail only then. `written`: tierflow
// writes it (TIERFLOW_REPORT), making the directories missing on the way, so the nearest one that exists must be a
// directory and writable now, not at the process's exit.
auto file_parser(std::string Config::*field, std::string_view accepted, bool written = false) {
  return [=](Config& c, std::string_view name, std::string_view v) {
    std::string path = trim(v);
    struct stat st {};
    if (!path.empty() && (path.back() == '/' || (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))))
      bad_value(name, v, accepted, "it is a directory");
    if (written && !path.empty()) {
      std::string dir = path;
      struct stat dst {};
      for (;;) {  // up to the nearest part of the path that exists
        const std::size_t slash = dir.rfind('/');
        dir = slash == std::string::npos ? "." : slash == 0 ? "/" : dir.substr(0, slash);
        if (::stat(dir.c_str(), &dst) == 0 || dir == "." || dir == "/") break;
      }
      if (!S_ISDIR(dst.st_mode))
        bad_value(name, v, accepted, quote_config_value(dir) + " on its way is not a directory");
      if (::access(dir.c_str(), W_OK) != 0)
        bad_value(name, v, accepted, "its directory " + quote_config_value(dir) + " is not writable");
    }
    c.*field = std::move(path);
  };
}

auto size_parser(std::uint64_t Config::*field, std::uint64_t minimum, std::string_view accepted) {
  return [field, minimum, accepted](Config& c, std::string_view name, std::string_view v) {
    auto s = parse_size(v);
    if (!s || *s < minimum) bad_value(name, v, accepted);
    c.*field = *s;
  };
}

auto on_off_parser(bool Config::*field) {
  return [field](Config& c, std::string_view name, std::string_view v) {
    std::string s = lower(trim(v));
    if (s == "on") c.*field = true;
    else if (s == "off") c.*field = false;
    else bad_value(name, v, "on or off");
  };
}

// Which values of OffloadTarget a placement setting accepts beyond none, host and nvme.
enum class TargetValues : std::uint8_t {
  kTiers,        ///< none, host, nvme (the optimizer)
  kTiersAuto,    ///< and auto (parameters)
  kActivations,  ///< and recompute and auto (activations)
};

auto target_parser(OffloadTarget Config::*field, TargetValues values) {
  return [field, values](Config& c, std::string_view name, std::string_view v) {
    std::string s = lower(trim(v));
    if (s == "none") c.*field = OffloadTarget::kNone;
    else if (s == "host") c.*field = OffloadTarget::kHost;
    else if (s == "nvme") c.*field = OffloadTarget::kNvme;
    else if (s == "auto" && values != TargetValues::kTiers) c.*field = OffloadTarget::kAuto;
    else if (s == "recompute" && values == TargetValues::kActivations) c.*field = OffloadTarget::kRecompute;
    else
      bad_value(name, v,
                values == TargetValues::kActivations ? "one of none, host, nvme, recompute, auto"
                : values == TargetValues::kTiersAuto ? "one of none, host, nvme, auto"
                                                     : "one of none, host, nvme");
  };
}

// TIERFLOW_NVME_PATHS: a path that exists must be a directory (a file there fails only when the engine opens
// its swap file), and no directory may be named twice, directly or through a link: the engine would take it for
// two devices and stripe over one. A path that does not exist yet is the runtime's to refuse (tiering/tiers.cpp).
void check_nvme_directories(std::string_view name, std::string_view v, const std::vector<std::string>& paths) {
  constexpr std::string_view kAccepted = "a comma-separated list of distinct directories, e.g. /mnt/nvme0,/mnt/nvme1";
  std::vector<std::pair<std::string, struct stat>> seen;
  for (const auto& p : paths) {
    std::string bare = p;
    while (bare.size() > 1 && bare.back() == '/') bare.pop_back();
    struct stat st {};
    const bool exists = ::stat(p.c_str(), &st) == 0;
    if (exists && !S_ISDIR(st.st_mode))
      bad_value(name, v, kAccepted, quote_config_value(p) + ": Not a directory");
    for (const auto& [other, other_st] : seen) {
      std::string other_bare = other;
      while (other_bare.size() > 1 && other_bare.back() == '/') other_bare.pop_back();
      const bool same_file = exists && other_st.st_ino != 0 && st.st_dev == other_st.st_dev && st.st_ino == other_st.st_ino;
      if (bare == other_bare || same_file)
        bad_value(name, v, kAccepted,
                  quote_config_value(other) + " and " + quote_config_value(p) +
                      " are the same directory (named twice, or through a link), which would be taken for two devices");
    }
    if (!exists) st = {};
    seen.emplace_back(p, st);
  }
}

// The tiers' budgets and the NVMe engine.
// TIERFLOW_STALL_TIMEOUT (Note [Stall timeout]): a duration of at least a second ("600", "30s", "10min", "1h"),
// or none; 0 in any unit ("0", "0s") is none too. Under a second is refused: a loaded machine's healthy copy
// can take that long, and a limit that small is a typo for a larger one.
constexpr const char* kStallTimeoutAccepted =
    "a duration of at least 1 second: seconds (e.g. 600), 30s, 10min, 1h; or none (no limit; 0 and 0s also mean none)";

void stall_timeout_parser(Config& c, std::string_view name, std::string_view v) {
  std::string s = lower(trim(v));
  if (s == "none" || s == "off") {
    c.stall_timeout_seconds = 0.0;
    return;
  }
  double unit = 1.0;
  if (s.size() > 3 && s.compare(s.size() - 3, 3, "min") == 0) {
    unit = 60.0;
    s.resize(s.size() - 3);
  } else if (s.size() > 1 && s.back() == 'h') {
    unit = 3600.0;
    s.pop_back();
  } else if (s.size() > 1 && s.back() == 's') {
    s.pop_back();
  }
  auto x = parse_decimal(trim(s));
  if (!x || !(*x >= 0.0) || *x * unit > 1e9) bad_value(name, v, kStallTimeoutAccepted);
  if (*x == 0.0) {
    c.stall_timeout_seconds = 0.0;  // none
    return;
  }
  if (*x * unit < kMinStallTimeout)
    bad_value(name, v, kStallTimeoutAccepted,
              "under a second is refused: a healthy copy on a loaded machine can take that long");
  c.stall_timeout_seconds = *x * unit;
}

std::vector<Row> memory_rows() {
  return {
    {{"TIERFLOW_GPU_MEMORY", "90%", kBudgetForms,
      "device memory the activation planner may use (`auto`: the whole step's peak, parameters, "
      "gradients and optimizer states included); a percentage is of the device's total memory"},
     budget_parser(&Config::gpu_memory, /*nonzero=*/true)},
    {{"TIERFLOW_HOST_MEMORY", "50%", kBudgetForms,
      "pinned host pool budget (offloaded activations, optimizer states, staging); a "
      "percentage is of physical RAM"},
     budget_parser(&Config::host_memory, /*nonzero=*/true)},
    {{"TIERFLOW_NVME_PATHS", "", "a comma-separated list of directories, e.g. /mnt/nvme0,/mnt/nvme1",
      "directories on NVMe file systems that hold tierflow's swap files"},
     [](Config& c, std::string_view name, std::string_view v) {
       // Every item counts: an empty one (",a", "a,", "a,,b") is refused, never dropped.
       c.nvme_paths.clear();
       if (trim(v).empty()) return;
       for (std::size_t b = 0;;) {
         const std::size_t e = std::min(v.find(',', b), v.size());
         std::string item = trim(v.substr(b, e - b));
         if (item.empty())
           bad_value(name, v, "a comma-separated list of directories with no empty entries",
                     "item " + std::to_string(c.nvme_paths.size() + 1) + " is empty");
         c.nvme_paths.push_back(std::move(item));
         if (e == v.size()) break;
         b = e + 1;
       }
       check_nvme_directories(name, v, c.nvme_paths);
     }},
    // `auto` is the Budget of kNvmeAutoBytes bytes (swap::kNvmeAutoBytes, Note [NVMe space]).
    {{"TIERFLOW_NVME_MEMORY", "auto",
      "auto, or a size (e.g. 512MiB, 1.5GiB, 4096; units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB) or a "
      "percentage of the free space in (0%, 100%], e.g. 80%",
      "most bytes each swap file under TIERFLOW_NVME_PATHS may grow to; files grow as the run needs and "
      "the NVMe optimizer reserves its states at wrap; `auto`: as far as the file system keeps 10% of its "
      "size free; a percentage is of the free space when the run starts"},
     [](Config& c, std::string_view name, std::string_view v) {
       constexpr std::string_view kForms =
           "auto, or a size (e.g. 512MiB, 1.5GiB, 4096; units B, KiB, MiB, GiB, TiB, KB, MB, GB, TB) or a "
           "percentage of the free space in (0%, 100%], e.g. 80%";
       if (trim(v) == "auto") {
         c.nvme_memory = Budget{kNvmeAutoBytes, 0.0, false};
         return;
       }
       auto b = parse_budget(v);
       if (!b || (!b->is_fraction && b->bytes == kNvmeAutoBytes)) bad_value(name, v, kForms);
       c.nvme_memory = *b;
     }},
    {{"TIERFLOW_AIO_BLOCK_SIZE", "1MiB", "a multiple of 4KiB from 4KiB to 64MiB, e.g. 1MiB",
      "request size of NVMe I/O; a block is striped over the paths in requests of this size"},
     [](Config& c, std::string_view name, std::string_view v) {
       auto s = parse_size(v);
       if (!s || *s < 4 * KiB || *s > 64 * MiB || *s % (4 * KiB) != 0)
         bad_value(name, v, "a multiple of 4KiB from 4KiB to 64MiB, e.g. 1MiB");
       c.aio_block_size = *s;
     }},
    {{"TIERFLOW_AIO_QUEUE_DEPTH", "32", "an integer from 1 to 1024",
      "NVMe requests kept in flight"},
     int_parser(&Config::aio_queue_depth, 1, 1024, "an integer from 1 to 1024")},
    {{"TIERFLOW_NVME_CHECKSUM", "on", "on or off",
      "checksum every block written to NVMe (XXH3) and verify it on read"},
     on_off_parser(&Config::nvme_checksum)},
  };
}

// What goes where, the CPU optimizer's states' format, threads and SIMD path.
std::vector<Row> placement_rows() {
  return {
    {{"TIERFLOW_OFFLOAD_ACTIVATIONS", "auto", "one of none, host, nvme, recompute, auto",
      "where tensors saved for backward go: none keeps them on the device; host (nvme) swaps "
      "every one to the pinned host pool (NVMe); recompute swaps each block's input and "
      "recomputes the block in backward; auto plans per block (keep, swap a share of the "
      "tokens, recompute) from the first steps' measurements within TIERFLOW_GPU_MEMORY, and "
      "again before a batch larger than the plan was made for"},
     target_parser(&Config::offload_activations, TargetValues::kActivations)},
    {{"TIERFLOW_OFFLOAD_PARAMS", "none", "one of none, host, nvme, auto",
      "where the model's parameters live between uses: none keeps them on the device; host (nvme) keeps "
      "them in the pinned host pool (on NVMe, needs TIERFLOW_NVME_PATHS) and fetches each repeated block's, "
      "and each other module's, ahead of each call's forward and backward, releasing them after, within "
      "TIERFLOW_GPU_MEMORY (a use that cannot fit is refused by name); auto lets the activation "
      "plan (TIERFLOW_OFFLOAD_ACTIVATIONS=auto) keep each block's on the device or fetch it from the host, "
      "within TIERFLOW_GPU_MEMORY (Note [Parameter residency])"},
     target_parser(&Config::offload_params, TargetValues::kTiersAuto)},
    {{"TIERFLOW_OFFLOAD_OPTIMIZER", "host", "one of none, host, nvme",
      "where optimizer states and fp32 master weights live and step: host runs tierflow's CPU "
      "AdamW, none leaves the optimizer as it is"},
     target_parser(&Config::offload_optimizer, TargetValues::kTiers)},
    {{"TIERFLOW_OPTIMIZER_STATES", "fp32", "one of fp32, bf16, 8bit",
      "how the CPU AdamW keeps exp_avg and exp_avg_sq (the master stays fp32 and every step computes in fp32): "
      "fp32 (8 bytes a parameter), bf16 (4, rounded to nearest even) or 8bit (2 + two fp32 scales per 256, "
      "block-wise dynamic codes; Note [Optimizer state formats]); the same format on NVMe; refused with amsgrad"},
     [](Config& c, std::string_view name, std::string_view v) {
       const auto f = parse_state_format(lower(trim(v)));
       if (!f) bad_value(name, v, "one of fp32, bf16, 8bit");
       c.optimizer_states = *f;
     }},
    {{"TIERFLOW_CPU_THREADS", "auto", "auto or an integer from 1 to 1024",
      "threads of the CPU optimizer's oneTBB arena; auto uses every core"},
     [](Config& c, std::string_view name, std::string_view v) {
       std::string s = lower(trim(v));
       if (s == "auto") {
         c.cpu_threads = 0;
         return;
       }
       auto n = parse_uint(s, 1024);
       if (!n || *n < 1) bad_value(name, v, "auto or an integer from 1 to 1024");
       c.cpu_threads = static_cast<int>(*n);
     }},
    {{"TIERFLOW_CPU_ISA", "auto", "one of auto, avx512, avx2, portable",
      "SIMD path of the CPU optimizer; auto picks the widest this CPU runs (all give the same "
      "results)"},
     [](Config& c, std::string_view name, std::string_view v) {
       std::string s = lower(trim(v));
       if (s != "auto" && s != "avx512" && s != "avx2" && s != "portable")
         bad_value(name, v, "one of auto, avx512, avx2, portable");
       c.cpu_isa = s;
     }},
  };
}

// Logs, the stall timeout, the report, trace and profile files, re-planning.
std::vector<Row> log_and_file_rows() {
  return {
    {{"TIERFLOW_LOG_LEVEL", "warn", "one of error, warn, info, debug",
      "verbosity of tierflow's messages on stderr"},
     [](Config& c, std::string_view name, std::string_view v) {
       const std::optional<LogLevel> level = parse_log_level(v);
       if (!level) bad_value(name, v, "one of error, warn, info, debug");
       c.log_level = *level;
     }},
    {{"TIERFLOW_STALL_TIMEOUT", "10min", kStallTimeoutAccepted,
      "a copy, an NVMe request or a CPU optimizer step still unfinished this long after it started raises an "
      "error (StallError, a TimeoutError) naming it and what was in flight (Note [Stall timeout]); no healthy "
      "step comes near 10 minutes; one value per process"},
     stall_timeout_parser},
    {{"TIERFLOW_REPORT", "", "a file path under a writable folder (empty: no file)",
      "write the statistics report as JSON to this path when the process exits and on every "
      "tierflow.report() call"},
     file_parser(&Config::report_path, "a file path under a writable folder (empty: no file)", /*written=*/true)},
    {{"TIERFLOW_TRACE", "", "a file path under a writable folder (empty: no trace)",
      "record a trace of every step (blocks' forward, backward and replay, copies, NVMe reads and writes, the CPU "
      "AdamW's buckets, bytes per tier) and write it in the Chrome trace format (Perfetto, chrome://tracing; "
      "merges with torch.profiler's) to this path when the wrapped model's runtime ends and at exit (Note [Trace])"},
     [](Config& c, std::string_view name, std::string_view v) {
       constexpr std::string_view kAccepted = "a file path under a writable folder (empty: no trace)";
       file_parser(&Config::trace_path, kAccepted, /*written=*/true)(c, name, v);
       // The writer makes no folders: the file's own must exist (the runtime's attach also tries to write there).
       const std::string& path = c.trace_path;
       const std::size_t slash = path.rfind('/');
       const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
       struct stat st {};
       if (!path.empty() && (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)))
         bad_value(name, v, kAccepted, "its folder " + quote_config_value(dir) + " does not exist; keyword trace");
     }},
    {{"TIERFLOW_PROFILE", "", "a file path (empty: measure every run)",
      "the activation planner's block profile: read from this file when it exists, otherwise "
      "measured in the first step and written there"},
     file_parser(&Config::profile_path, "a file path (empty: measure every run)")},
    {{"TIERFLOW_REPLAN", "on", "on or off",
      "re-plan the activations once when the steps under the plan take more than 25% longer or "
      "shorter than it predicted, from its figures calibrated on that measurement (see Note [Re-plan])"},
     on_off_parser(&Config::replan)},
  };
}

// Activation sizes: the least offloaded, the prefetch window, the host pool's pinned slabs.
std::vector<Row> activation_size_rows() {
  return {
    {{"TIERFLOW_MIN_OFFLOAD_BYTES", "64KiB", "a size, e.g. 0, 4096, 64KiB, 1MiB",
      "saved tensors smaller than this stay on the device (copying them costs more than it saves)"},
     size_parser(&Config::min_offload_bytes, 0, "a size, e.g. 0, 4096, 64KiB, 1MiB")},
    {{"TIERFLOW_PREFETCH_BYTES", "64MiB", "a size of at least 1 byte, e.g. 8MiB, 256MiB",
      "how many bytes of offloaded activations backward prefetches ahead of their use (and forward copies to "
      "the host at once); under an activation plan, at least this: the largest swap of two neighbouring blocks "
      "where the device budget has room (see Note [Overlap window])"},
     size_parser(&Config::prefetch_bytes, 1, "a size of at least 1 byte, e.g. 8MiB, 256MiB")},
    {{"TIERFLOW_PINNED_SLAB_BYTES", "64MiB", "a size of at least 64KiB, e.g. 64MiB, 1GiB",
      "size of each pinned slab the host pool allocates at once (pinning is slow, so it is "
      "done per slab, not per tensor)"},
     size_parser(&Config::pinned_slab_bytes, 64 * KiB, "a size of at least 64KiB, e.g. 64MiB, 1GiB")},
  };
}

// The step during backward, clipping, the GPU share.
std::vector<Row> step_rows() {
  return {
    {{"TIERFLOW_OVERLAP_STEP", "on", "on or off",
      "step each parameter on the CPU as soon as backward completes its gradient, while backward "
      "goes on; step() then only confirms (see Note [Step during backward])"},
     on_off_parser(&Config::overlap_step)},
    {{"TIERFLOW_PARTITION_OPTIMIZER", "off", "on or off",
      "under DistributedDataParallel with several ranks: on, each rank keeps the CPU optimizer's states of, and "
      "steps, its own share of the parameters DDP reduces, then broadcasts their new weights (ZeRO-Offload's "
      "design: one copy of the states on the node), and each rank saves and loads its own optimizer state dict; "
      "off, every rank steps every parameter (see Note [Partitioned optimizer])"},
     on_off_parser(&Config::partition_optimizer)},
    {{"TIERFLOW_GRAD_BUCKET_BYTES", "auto", "auto or a size of at least 4KiB, e.g. 16MiB",
      "gradients travel device->host and step on the CPU in buckets of this size while backward "
      "goes on; auto: about 16 buckets (4MiB to 64MiB) until a steady step (see Note [Steady step]), "
      "then the largest whose copy and CPU step, at the measured link and AdamW rates, take 2% of the "
      "measured backward (see Note [Gradient streaming])"},
     [](Config& c, std::string_view name, std::string_view v) {
       if (lower(trim(v)) == "auto") {
         c.grad_bucket_bytes = 0;
         return;
       }
       auto s = parse_size(v);
       if (!s || *s < 4 * KiB) bad_value(name, v, "auto or a size of at least 4KiB, e.g. 16MiB");
       c.grad_bucket_bytes = *s;
     }},
    {{"TIERFLOW_WEIGHTS_RETURN", "step", "step or forward",
      "when updated weights of a device model are back on the device: step (when step() returns, "
      "as torch's) or forward (each module's forward waits only for its own weights, so the "
      "copies overlap the next forward; read parameters outside a forward only after "
      "optimizer.synchronize())"},
     [](Config& c, std::string_view name, std::string_view v) {
       std::string s = lower(trim(v));
       if (s == "step") c.weights_return_in_forward = false;
       else if (s == "forward") c.weights_return_in_forward = true;
       else bad_value(name, v, "step or forward");
     }},
    {{"TIERFLOW_OFFLOAD_GRADIENTS", "off", "on or off",
      "on: a device model's gradient is freed on the device as soon as its copy to the host is "
      "done, during backward (p.grad is None from then on, as after zero_grad; clip with "
      "TIERFLOW_MAX_GRAD_NORM, not clip_grad_norm_; no GradScaler); off: p.grad stays on the device "
      "until zero_grad, as torch's (see Note [Gradient streaming])"},
     on_off_parser(&Config::offload_gradients)},
    {{"TIERFLOW_GRAD_ACCUMULATION_STEPS", "1", "an integer from 1 to 1000000",
      "backward passes per optimizer step; steps during backward run only in the last one (a "
      "wrong value costs time, never correctness)"},
     int_parser(&Config::grad_accumulation_steps, 1, 1000000, "an integer from 1 to 1000000")},
    {{"TIERFLOW_MAX_GRAD_NORM", "none", "none or a positive number, e.g. 1.0",
      "clip the global gradient 2-norm to this value before the step, exactly as "
      "torch.nn.utils.clip_grad_norm_"},
     [](Config& c, std::string_view name, std::string_view v) {
       std::string s = lower(trim(v));
       if (s == "none") {
         c.max_grad_norm = 0.0;
         return;
       }
       auto x = parse_decimal(s);
       if (!x || !(*x > 0.0)) bad_value(name, v, "none or a positive number, e.g. 1.0");
       c.max_grad_norm = *x;
     }},
    {{"TIERFLOW_SKIP_NONFINITE", "off", "on or off",
      "skip the whole step (state untouched) when any gradient holds inf or NaN, as AMP's "
      "GradScaler does"},
     on_off_parser(&Config::skip_nonfinite)},
    {{"TIERFLOW_GPU_OPTIMIZER_FRACTION", "auto", "auto or a number from 0 to 1",
      "share of the parameters (by elements) of CUDA models whose optimizer state stays on the "
      "GPU and steps there (Deep Optimizer States); the rest steps on the CPU; auto picks, at the "
      "first steady step (see Note [Steady step]), the share that makes the CPU's step end with "
      "backward, within what TIERFLOW_GPU_MEMORY leaves (0 without CUDA)"},
     [](Config& c, std::string_view name, std::string_view v) {
       std::string s = lower(trim(v));
       if (s == "auto") {
         c.gpu_optimizer_fraction_auto = true;
         c.gpu_optimizer_fraction = 0.0;
         return;
       }
       auto x = parse_decimal(s);
       if (!x || !(*x >= 0.0 && *x <= 1.0)) bad_value(name, v, "auto or a number from 0 to 1");
       c.gpu_optimizer_fraction_auto = false;
       c.gpu_optimizer_fraction = *x == 0.0 ? 0.0 : *x;  // -0 is 0
     }},
  };
}

// The allocator and the device (real or emulated).
std::vector<Row> device_rows() {
  return {
    {{"TIERFLOW_MIMALLOC", "on", "on or off",
      "serve tierflow's own small allocations from mimalloc (off: the C library, e.g. under "
      "sanitizers)"},
     on_off_parser(&Config::mimalloc)},
    {{"TIERFLOW_DEVICE", "auto", "one of auto, cuda, emulated",
      "the GPU tier: cuda drives the CUDA GPU (an error when there is none), emulated uses host "
      "memory and worker threads (CPU models; see TIERFLOW_EMULATED_DEVICE), auto picks cuda when "
      "a GPU is present"},
     [](Config& c, std::string_view name, std::string_view v) {
       std::string s = lower(trim(v));
       if (s == "auto") c.device = DeviceChoice::kAuto;
       else if (s == "cuda") c.device = DeviceChoice::kCuda;
       else if (s == "emulated") c.device = DeviceChoice::kEmulated;
       else bad_value(name, v, "one of auto, cuda, emulated");
     }},
    {{"TIERFLOW_EMULATED_DEVICE", "polite", "polite or adversarial",
      "behaviour of the emulated device: adversarial completes copies late and out of order, "
      "poisons data that a copy reads or writes without being ordered after its producer, and "
      "poisons and checks freed memory (a test mode that makes stream-ordering bugs visible "
      "without a GPU; see Note [Adversarial emulated device])"},
     [](Config& c, std::string_view name, std::string_view v) {
       std::string s = lower(trim(v));
       if (s == "polite") c.emulated_device = EmulationMode::kPolite;
       else if (s == "adversarial") c.emulated_device = EmulationMode::kAdversarial;
       else bad_value(name, v, "polite or adversarial");
     }},
    {{"TIERFLOW_EMULATED_SEED", "1", "an integer from 0 to 2^63",
      "seed of the adversarial emulated device's random copy delays (the same seed gives the "
      "same delays for the same sequence of copies)"},
     [](Config& c, std::string_view name, std::string_view v) {
       auto n = parse_uint(v, 1ULL << 63);
       if (!n) bad_value(name, v, "an integer from 0 to 2^63");
       c.emulated_seed = *n;
     }},
  };
}

}  // namespace

// The table, in its order (docs/configuration.md lists it so).
const std::vector<Row>& rows() {
  static const std::vector<Row> kRows = [] {
    std::vector<Row> all;
    for (auto part :
         {memory_rows, placement_rows, log_and_file_rows, activation_size_rows, step_rows, device_rows}) {
      std::vector<Row> r = part();
      all.insert(all.end(), std::make_move_iterator(r.begin()), std::make_move_iterator(r.end()));
    }
    return all;
  }();
  return kRows;
}

const Row* find_row(std::string_view name) {
  for (const auto& r : rows())
    if (r.entry.name == name) return &r;
  return nullptr;
}

}  // namespace tierflow::config_detail
