#include "tierflow/core/config.hpp"

#include <algorithm>
#include <iterator>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>

#include <sys/stat.h>
#include <unistd.h>

#include "tierflow/core/error.hpp"

extern char** environ;

namespace tierflow {
namespace {

constexpr std::string_view kPrefix = "TIERFLOW_";

// Length of the valid UTF-8 sequence at the start of `s` (no overlong forms, surrogates or code
// points past U+10FFFF), or 0 when it is not one.
std::size_t utf8_sequence(std::string_view s) {
  const auto b = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  std::size_t n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
  if (n == 0 || s.size() < n) return 0;
  for (std::size_t i = 1; i < n; ++i)
    if ((b(i) & 0xC0) != 0x80) return 0;
  if (c == 0xE0 && b(1) < 0xA0) return 0;   // overlong
  if (c == 0xED && b(1) >= 0xA0) return 0;  // UTF-16 surrogate
  if (c == 0xF0 && b(1) < 0x90) return 0;   // overlong
  if (c == 0xF4 && b(1) >= 0x90) return 0;  // past U+10FFFF
  return n;
}

bool printable_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s.substr(i));
    if (n == 0 || s[i] == '\0') return false;
    i += n;
  }
  return true;
}

}  // namespace

std::string quote_config_value(std::string_view value) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (std::size_t i = 0; i < value.size();) {
    const auto c = static_cast<unsigned char>(value[i]);
    const std::size_t n = utf8_sequence(value.substr(i));
    const auto c1 = n > 1 ? static_cast<unsigned char>(value[i + 1]) : 0;
    const auto c2 = n > 2 ? static_cast<unsigned char>(value[i + 2]) : 0;
    // C1 controls (U+0080..U+009F: NEL breaks lines) and the line and paragraph separators.
    if ((n == 2 && c == 0xC2 && c1 < 0xA0) || (n == 3 && c == 0xE2 && c1 == 0x80 && (c2 == 0xA8 || c2 == 0xA9))) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", n == 2 ? c1 : 0x2000 + (c2 == 0xA8 ? 0x28 : 0x29));
      out += buf;
      i += n;
      continue;
    }
    if (n > 1 || (n == 1 && c >= 0x20 && c != 0x7F && c != '\'' && c != '\\')) {
      out.append(value.substr(i, n));
      i += n;
      continue;
    }
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c == '\'' || c == '\\') (out += '\\') += static_cast<char>(c);
    else ((out += "\\x") += kHex[c >> 4]) += kHex[c & 15];
    ++i;
  }
  return out + "'";
}

namespace {

// `reason`, when given, says why a value of an accepted-looking form is refused ("it is a directory").
[[noreturn]] void bad_value(std::string_view name, std::string_view value, std::string_view accepted,
                            std::string_view reason = {}) {
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

// One row: the public part plus the parser that stores a value into Config.
struct Row {
  ConfigEntry entry;
  std::function<void(Config&, std::string_view name, std::string_view value)> apply;
};


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

// What goes where, the CPU optimizer's threads, logs, files, activation sizes.
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
    {{"TIERFLOW_LOG_LEVEL", "warn", "one of error, warn, info, debug",
      "verbosity of tierflow's messages on stderr"},
     [](Config& c, std::string_view name, std::string_view v) {
       std::string s = lower(trim(v));
       if (s == "error") c.log_level = LogLevel::kError;
       else if (s == "warn" || s == "warning") c.log_level = LogLevel::kWarn;
       else if (s == "info") c.log_level = LogLevel::kInfo;
       else if (s == "debug") c.log_level = LogLevel::kDebug;
       else bad_value(name, v, "one of error, warn, info, debug");
     }},
    {{"TIERFLOW_REPORT", "", "a file path under a writable folder (empty: no file)",
      "write the statistics report as JSON to this path when the process exits and on every "
      "tierflow.report() call"},
     file_parser(&Config::report_path, "a file path under a writable folder (empty: no file)", /*written=*/true)},
    {{"TIERFLOW_PROFILE", "", "a file path (empty: measure every run)",
      "the activation planner's block profile: read from this file when it exists, otherwise "
      "measured in the first step and written there"},
     file_parser(&Config::profile_path, "a file path (empty: measure every run)")},
    {{"TIERFLOW_REPLAN", "on", "on or off",
      "re-plan the activations once when the steps under the plan take more than 25% longer or "
      "shorter than it predicted, from its figures calibrated on that measurement (see Note [Re-plan])"},
     on_off_parser(&Config::replan)},
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

// The table, in its order (docs/configuration.md lists it so).
const std::vector<Row>& rows() {
  static const std::vector<Row> kRows = [] {
    std::vector<Row> all;
    for (auto part : {memory_rows, placement_rows, step_rows, device_rows}) {
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

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Maps a keyword ("host_memory") or a full name to the full variable name.
std::string full_name(std::string_view key) {
  std::string upper(key);
  for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (upper.rfind(kPrefix, 0) == 0) return upper;
  return std::string(kPrefix) + upper;
}

std::string format_double(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

std::string keyword_of(std::string_view name) { return lower(name.substr(kPrefix.size())); }

}  // namespace

std::string_view to_string(OffloadTarget t) noexcept {
  switch (t) {
    case OffloadTarget::kNone: return "none";
    case OffloadTarget::kHost: return "host";
    case OffloadTarget::kNvme: return "nvme";
    case OffloadTarget::kAuto: return "auto";
    case OffloadTarget::kRecompute: return "recompute";
  }
  return "?";
}

std::string_view to_string(DeviceChoice d) noexcept {
  switch (d) {
    case DeviceChoice::kAuto: return "auto";
    case DeviceChoice::kCuda: return "cuda";
    case DeviceChoice::kEmulated: return "emulated";
  }
  return "?";
}

std::string_view to_string(EmulationMode m) noexcept {
  return m == EmulationMode::kAdversarial ? "adversarial" : "polite";
}

std::string_view to_string(LogLevel l) noexcept {
  switch (l) {
    case LogLevel::kError: return "error";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kInfo: return "info";
    case LogLevel::kDebug: return "debug";
  }
  return "?";
}

const std::vector<ConfigEntry>& config_table() {
  static const std::vector<ConfigEntry> kTable = [] {
    std::vector<ConfigEntry> t;
    for (const auto& r : rows()) t.push_back(r.entry);
    return t;
  }();
  return kTable;
}

std::string closest_config_name(std::string_view name) {
  std::string best;
  std::size_t best_d = ~std::size_t{0};
  for (const auto& r : rows()) {
    std::size_t d = edit_distance(name, r.entry.name);
    if (d < best_d) {
      best_d = d;
      best = std::string(r.entry.name);
    }
  }
  return best;
}

Config Config::defaults() { return parse({}, {}); }

namespace {

// Parses one value into `c`; errors name `label` (the variable, or a command-line flag standing for it).
void apply_row(Config& c, const Row& row, std::string_view label, std::string_view value) {
  // The environment holds bytes; every value is text, and a message quoting it must stay valid UTF-8.
  if (!printable_utf8(value)) bad_value(label, value, row.entry.accepted, "not UTF-8 text");
  row.apply(c, label, value);
}

}  // namespace

Config Config::parse(const std::map<std::string, std::string>& variables,
                     const std::map<std::string, std::string>& overrides) {
  Config c;
  for (const auto& r : rows()) r.apply(c, r.entry.name, r.entry.default_value);
  for (const auto& [name, value] : variables) {
    if (name.rfind(kPrefix, 0) != 0) continue;
    const Row* row = find_row(name);
    if (!row) {
      throw config_error("unknown environment variable " + quote_config_value(name) + "; did you mean " +
                         closest_config_name(name) +
                         "? (tierflow.config_table() lists every accepted variable)");
    }
    apply_row(c, *row, row->entry.name, value);
    c.given.emplace(row->entry.name);
  }
  for (const auto& [key, value] : overrides) {
    std::string name = full_name(key);
    const Row* row = find_row(name);
    if (!row) {
      throw config_error("unknown tierflow setting " + quote_config_value(key) + "; did you mean '" +
                         keyword_of(closest_config_name(name)) +
                         "'? (tierflow.config_table() lists every accepted setting)");
    }
    apply_row(c, *row, row->entry.name, value);
    c.given.emplace(row->entry.name);
  }
  return c;
}

std::string parse_setting(std::string_view name, std::string_view value, std::string_view label) {
  const std::string full = full_name(name);
  const Row* row = find_row(full);
  if (!row) throw config_error("unknown tierflow setting " + quote_config_value(name));
  Config c = Config::defaults();
  apply_row(c, *row, label.empty() ? std::string_view(row->entry.name) : label, value);
  return c.to_strings().at(full);
}

Config Config::from_environment(const std::map<std::string, std::string>& overrides) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    std::string_view k = kv.substr(0, eq);
    if (k.rfind(kPrefix, 0) == 0) vars.emplace(std::string(k), std::string(kv.substr(eq + 1)));
  }
  return parse(vars, overrides);
}

std::map<std::string, std::string> Config::to_strings() const {
  std::string paths;
  for (std::size_t i = 0; i < nvme_paths.size(); ++i) paths += (i ? "," : "") + nvme_paths[i];
  return {
      {"TIERFLOW_GPU_MEMORY", gpu_memory.to_string()},
      {"TIERFLOW_HOST_MEMORY", host_memory.to_string()},
      {"TIERFLOW_NVME_PATHS", paths},
      {"TIERFLOW_NVME_MEMORY",
       !nvme_memory.is_fraction && nvme_memory.bytes == kNvmeAutoBytes ? "auto" : nvme_memory.to_string()},
      {"TIERFLOW_AIO_BLOCK_SIZE", std::to_string(aio_block_size)},
      {"TIERFLOW_AIO_QUEUE_DEPTH", std::to_string(aio_queue_depth)},
      {"TIERFLOW_NVME_CHECKSUM", nvme_checksum ? "on" : "off"},
      {"TIERFLOW_OFFLOAD_ACTIVATIONS", std::string(to_string(offload_activations))},
      {"TIERFLOW_OFFLOAD_PARAMS", std::string(to_string(offload_params))},
      {"TIERFLOW_OFFLOAD_OPTIMIZER", std::string(to_string(offload_optimizer))},
      {"TIERFLOW_OPTIMIZER_STATES", to_string(optimizer_states)},
      {"TIERFLOW_CPU_THREADS", cpu_threads == 0 ? "auto" : std::to_string(cpu_threads)},
      {"TIERFLOW_CPU_ISA", cpu_isa},
      {"TIERFLOW_LOG_LEVEL", std::string(to_string(log_level))},
      {"TIERFLOW_REPORT", report_path},
      {"TIERFLOW_PROFILE", profile_path},
      {"TIERFLOW_REPLAN", replan ? "on" : "off"},
      {"TIERFLOW_MIN_OFFLOAD_BYTES", std::to_string(min_offload_bytes)},
      {"TIERFLOW_PREFETCH_BYTES", std::to_string(prefetch_bytes)},
      {"TIERFLOW_PINNED_SLAB_BYTES", std::to_string(pinned_slab_bytes)},
      {"TIERFLOW_OVERLAP_STEP", overlap_step ? "on" : "off"},
      {"TIERFLOW_PARTITION_OPTIMIZER", partition_optimizer ? "on" : "off"},
      {"TIERFLOW_GRAD_ACCUMULATION_STEPS", std::to_string(grad_accumulation_steps)},
      {"TIERFLOW_MAX_GRAD_NORM", max_grad_norm > 0 ? format_double(max_grad_norm) : "none"},
      {"TIERFLOW_SKIP_NONFINITE", skip_nonfinite ? "on" : "off"},
      {"TIERFLOW_GPU_OPTIMIZER_FRACTION",
       gpu_optimizer_fraction_auto ? "auto" : format_double(gpu_optimizer_fraction)},
      {"TIERFLOW_GRAD_BUCKET_BYTES", grad_bucket_bytes == 0 ? "auto" : std::to_string(grad_bucket_bytes)},
      {"TIERFLOW_WEIGHTS_RETURN", weights_return_in_forward ? "forward" : "step"},
      {"TIERFLOW_OFFLOAD_GRADIENTS", offload_gradients ? "on" : "off"},
      {"TIERFLOW_MIMALLOC", mimalloc ? "on" : "off"},
      {"TIERFLOW_DEVICE", std::string(to_string(device))},
      {"TIERFLOW_EMULATED_DEVICE", std::string(to_string(emulated_device))},
      {"TIERFLOW_EMULATED_SEED", std::to_string(emulated_seed)},
  };
}

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
