// A transformers config.json into a TransformerShape; see Note [Model families] in model_config.hpp.
#include "tierflow/tiering/model_config.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {
namespace {

using Json = nlohmann::json;

// One family: its name, and what its config class says where config.json is silent.
struct Family {
  const char* model_type;
  const char* name;
  bool gpt2 = false;          // GPT-2's field names and block
  int head_dim = 0;           // the class's default head_dim (0: hidden / heads)
  bool tied = false;          // tie_word_embeddings' default
  std::int64_t max_positions = 0;
  bool qkv_bias_always = false;  // qwen2: q, k, v biases whatever attention_bias says
  bool attention_bias = false;   // reads attention_bias (llama, qwen3): q, k, v (and o, but qwen3's too)
  bool mlp_bias = false;         // reads mlp_bias (llama)
  bool qk_norm = false;
  int moe = 0;  // 1: mixtral's fields, 2: qwen3_moe's
};

const std::vector<Family>& families() {
  static const std::vector<Family> kFamilies = {
      {"llama", "Llama", false, 0, false, 2048, false, true, true, false, 0},
      {"mistral", "Mistral", false, 0, false, 131072, false, false, false, false, 0},
      {"qwen2", "Qwen2", false, 0, false, 32768, true, false, false, false, 0},
      {"qwen3", "Qwen3", false, 128, false, 32768, false, true, false, true, 0},
      {"gemma", "Gemma", false, 256, true, 8192, false, true, false, false, 0},
      {"phi3", "Phi-3", false, 0, false, 4096, false, false, false, false, 0},
      {"gpt2", "GPT-2", true, 0, true, 1024, false, false, false, false, 0},
      {"mixtral", "Mixtral", false, 0, false, 131072, false, false, false, false, 1},
      {"qwen3_moe", "Qwen3-MoE", false, 0, false, 32768, false, true, false, true, 2},
  };
  return kFamilies;
}

std::string in_quotes(const std::string& s) { return "'" + s + "'"; }

// The fields of one config.json, each read with an error naming the file and the field.
struct Reader {
  const Json& j;
  const std::string& path;
  const std::string& model_type;

  [[noreturn]] void fail(const std::string& field, const std::string& what, const std::string& accepted) const {
    throw config_error(in_quotes(path) + ": " + field + " " + what + "; accepted: " + accepted);
  }
  const Json* find(const char* field) const {
    const auto it = j.find(field);
    return it == j.end() ? nullptr : &*it;
  }
  std::int64_t integer(const Json& v, const char* field, std::int64_t least, std::int64_t most) const {
    const std::string accepted = "an integer from " + std::to_string(least) + " to " + std::to_string(most);
    if (!v.is_number_integer()) fail(field, v.dump() + " is not an integer", accepted);
    // The value as given in the message (v.dump(): a large unsigned one too, not a substitute).
    const bool unsigned_big = v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(most);
    const std::int64_t n = unsigned_big ? most : v.get<std::int64_t>();
    if (unsigned_big || n < least || n > most) fail(field, v.dump() + " is not valid", accepted);
    return n;
  }
  // A required positive integer.
  std::int64_t required(const char* field, std::int64_t most) const {
    const Json* v = find(field);
    if (v == nullptr) {
      fail(field, "is missing",
           "a config.json of model_type " + in_quotes(model_type) + " with " + field + " an integer from 1 to " +
               std::to_string(most) + " (Note [Model families])");
    }
    return integer(*v, field, 1, most);
  }
  // An optional positive integer (null: absent).
  std::optional<std::int64_t> optional(const char* field, std::int64_t most) const {
    const Json* v = find(field);
    if (v == nullptr || v->is_null()) return std::nullopt;
    return integer(*v, field, 1, most);
  }
  bool flag(const char* field, bool otherwise) const {
    const Json* v = find(field);
    if (v == nullptr || v->is_null()) return otherwise;
    if (!v->is_boolean()) fail(field, v->dump() + " is not a boolean", "true or false");
    return v->get<bool>();
  }
};

// Intermediate widths and positions read from a config.json: at most this many.
constexpr std::int64_t kMostUnits = 1 << 24;

std::int64_t limit_of(std::string_view field) {
  for (const auto& l : transformer_shape_limits())
    if (l.field == field) return l.max;
  return 1 << 24;
}

// The text as a JSON object (not JSON, or not an object, refused).
Json parse_object(std::string_view text, const std::string& path) {
  Json j;
  try {
    j = Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    throw config_error(in_quotes(path) + ": not JSON (" + e.what() + "); accepted: a transformers config.json");
  }
  if (!j.is_object()) throw config_error(in_quotes(path) + ": not a JSON object; accepted: a transformers config.json");
  return j;
}

// The family config.json's model_type names (missing, or one tierflow plan does not read, refused).
const Family& family_of(const Json& j, const std::string& path) {
  std::string types;
  for (const auto& t : model_types()) types += (types.empty() ? "" : ", ") + t;
  const auto mt = j.find("model_type");
  if (mt == j.end() || !mt->is_string()) {
    throw config_error(in_quotes(path) + ": model_type is " + (mt == j.end() ? std::string("missing") : mt->dump()) +
                       "; accepted: a config.json whose model_type is one of " + types);
  }
  const std::string model_type = mt->get<std::string>();
  const auto fam = std::find_if(families().begin(), families().end(),
                                [&](const Family& f) { return model_type == f.model_type; });
  if (fam == families().end()) {
    throw config_error(in_quotes(path) + ": model_type " + in_quotes(model_type) +
                       " is not one tierflow plan reads; "
                       "accepted: " + types + " (Note [Model families]; or give the shape with --layers --hidden "
                       "--heads)");
  }
  return *fam;
}

// GPT-2's fields (n_embd, n_layer, n_head, n_inner, n_positions, activation_function) and its block.
void read_gpt2(const Reader& r, const Family& fam, ModelConfig& out) {
  TransformerShape& s = out.shape;
  s.hidden = static_cast<int>(r.required("n_embd", limit_of("hidden")));
  s.layers = static_cast<int>(r.required("n_layer", limit_of("layers")));
  s.heads = static_cast<int>(r.required("n_head", limit_of("heads")));
  s.intermediate = r.optional("n_inner", kMostUnits).value_or(4 * static_cast<std::int64_t>(s.hidden));
  out.max_positions = r.optional("n_positions", kMostUnits).value_or(fam.max_positions);
  s.positions = out.max_positions;
  // GPT-2's Conv1D projections all have biases; LayerNorm; GELU
  s.qkv_bias = s.output_bias = s.mlp_bias = true;
  // activation_function (default gelu_new): the tanh form written in Python ops saves three more tensors.
  const Json* act = r.find("activation_function");
  const std::string name = act == nullptr || act->is_null() ? "gelu_new" : act->is_string() ? act->get<std::string>()
                                                                                             : act->dump();
  s.activation_saved = name == "gelu_new" ? 3 : 0;
}

// The MLP of a Llama-style block: one (intermediate_size), or experts (Mixtral's or Qwen3-MoE's fields).
void read_mlp(const Reader& r, const Family& fam, TransformerShape& s) {
  if (fam.moe == 1) {
    s.experts = static_cast<int>(r.required("num_local_experts", 1 << 12));
    s.experts_per_token = static_cast<int>(r.required("num_experts_per_tok", s.experts));
    s.intermediate = r.required("intermediate_size", kMostUnits);
  } else if (fam.moe == 2) {
    s.experts = static_cast<int>(r.required("num_experts", 1 << 12));
    s.experts_per_token = static_cast<int>(r.required("num_experts_per_tok", s.experts));
    s.intermediate = r.required("moe_intermediate_size", kMostUnits);
    if (const auto step = r.optional("decoder_sparse_step", limit_of("layers")); step && *step != 1)
      r.fail("decoder_sparse_step", std::to_string(*step) + " is not supported", "1 (every block sparse)");
    if (const Json* dense = r.find("mlp_only_layers"); dense && !dense->is_null() &&
                                                      !(dense->is_array() && dense->empty())) {
      r.fail("mlp_only_layers", dense->dump() + " is not supported", "[] (every block sparse)");
    }
  } else {
    s.intermediate = r.required("intermediate_size", kMostUnits);
  }
}

// A Llama-style block's fields (hidden_size, num_hidden_layers, heads, head_dim, biases, the MLP).
void read_decoder(const Reader& r, const Family& fam, ModelConfig& out) {
  TransformerShape& s = out.shape;
  s.hidden = static_cast<int>(r.required("hidden_size", limit_of("hidden")));
  s.layers = static_cast<int>(r.required("num_hidden_layers", limit_of("layers")));
  s.heads = static_cast<int>(r.required("num_attention_heads", limit_of("heads")));
  s.kv_heads = static_cast<int>(r.optional("num_key_value_heads", s.heads).value_or(s.heads));
  if (s.heads % s.kv_heads != 0) {
    r.fail("num_key_value_heads", std::to_string(s.kv_heads) + " does not divide num_attention_heads " +
                                      std::to_string(s.heads), "a divisor of num_attention_heads");
  }
  const auto head_dim = r.optional("head_dim", 1 << 16);
  if (head_dim) {
    s.head_dim = static_cast<int>(*head_dim);
  } else if (fam.head_dim > 0 && r.find("head_dim") == nullptr) {
    s.head_dim = fam.head_dim;  // the class's default, where config.json leaves it out
  } else if (s.hidden % s.heads != 0) {
    r.fail("hidden_size", std::to_string(s.hidden) + " is not a multiple of num_attention_heads " +
                              std::to_string(s.heads), "a multiple, or head_dim given");
  }
  out.max_positions = r.optional("max_position_embeddings", kMostUnits).value_or(fam.max_positions);
  s.positions = 0;
  s.rms_norm = true;
  s.gated = true;
  const bool attention_bias = fam.attention_bias && r.flag("attention_bias", false);
  s.qkv_bias = fam.qkv_bias_always || attention_bias;
  s.output_bias = attention_bias;
  s.mlp_bias = fam.mlp_bias && r.flag("mlp_bias", false);
  s.qk_norm = fam.qk_norm;
  read_mlp(r, fam, s);
}

// torch_dtype (transformers 4) or dtype (5): out.dtype, and the shape's dtype_bytes.
void read_dtype(const Reader& r, ModelConfig& out) {
  TransformerShape& s = out.shape;
  const Json* dtype = r.find("torch_dtype");
  const char* dtype_field = "torch_dtype";
  if (dtype == nullptr || dtype->is_null()) {
    dtype = r.find("dtype");
    dtype_field = "dtype";
  }
  if (dtype != nullptr && !dtype->is_null()) {
    const std::string d = dtype->is_string() ? dtype->get<std::string>() : dtype->dump();
    if (d == "float32") out.dtype = "fp32";
    else if (d == "bfloat16") out.dtype = "bf16";
    else if (d == "float16") out.dtype = "fp16";
    else r.fail(dtype_field, in_quotes(d) + " is not valid", "float32, bfloat16 or float16 (or give --dtype)");
  }
  s.dtype_bytes = out.dtype == std::optional<std::string>("fp32") ? 4 : 2;
}

}  // namespace

const std::vector<std::string>& model_types() {
  static const std::vector<std::string> kTypes = [] {
    std::vector<std::string> out;
    for (const auto& f : families()) out.emplace_back(f.model_type);
    return out;
  }();
  return kTypes;
}

ModelConfig parse_model_config(std::string_view text, const std::string& path) {
  const Json j = parse_object(text, path);
  const Family& fam = family_of(j, path);
  ModelConfig out;
  out.path = path;
  out.model_type = fam.model_type;
  out.family = fam.name;
  const Reader r{j, path, out.model_type};
  TransformerShape& s = out.shape;
  s.seq = 0;
  s.batch = 0;
  s.vocab = r.required("vocab_size", limit_of("vocab"));
  if (fam.gpt2) read_gpt2(r, fam, out);
  else read_decoder(r, fam, out);
  s.tied = r.flag("tie_word_embeddings", fam.tied);
  read_dtype(r, out);
  return out;
}

ModelConfig load_model_config(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) file = (fs::path(path) / "config.json").string();
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    const char* why = fs::exists(file, ec) ? "no permission" : "no such file";
    throw config_error(in_quotes(file) + ": cannot be read (" + why +
                       "); accepted: a directory holding a transformers config.json, or the file itself");
  }
  std::ostringstream text;
  text << in.rdbuf();
  return parse_model_config(text.str(), file);
}

std::int64_t default_seq(const ModelConfig& config) noexcept {
  return std::clamp<std::int64_t>(config.max_positions, 1, 4096);
}

}  // namespace tierflow::tiering
