#include "launch/http/request_body.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace cpfill::launch {
namespace {

using Json = nlohmann::json;

// The SAX events of one body. Outside the prompt, values are placed into a DOM under `stack_`
// (the open containers, innermost last; a container's address stays valid while it is open,
// since only the innermost one grows). Inside the prompt a small state machine takes ids and
// texts straight into out_->prompts. The first problem stops the parse (a handler returning
// false ends nlohmann's sax_parse) and is kept in status_.
class BodySax : public nlohmann::json_sax<Json> {
 public:
  BodySax(std::string_view prompt_key, int64_t max_tokens, int max_prompts, RequestBody* out)
      : prompt_key_(prompt_key), max_tokens_(max_tokens), max_prompts_(max_prompts), out_(out) {}
  const absl::Status& status() const { return status_; }

  bool null() override { return Scalar(nullptr, "null"); }
  bool boolean(bool b) override { return Scalar(b, b ? "true" : "false"); }
  bool number_integer(number_integer_t v) override {
    return prompt_ != kNone ? PromptId(v, absl::StrCat(v)) : Scalar(v, "");
  }
  bool number_unsigned(number_unsigned_t v) override {
    const int64_t id = v > uint64_t{INT32_MAX} ? -1 : static_cast<int64_t>(v);
    return prompt_ != kNone ? PromptId(id, absl::StrCat(v)) : Scalar(v, "");
  }
  bool number_float(number_float_t v, const string_t& text) override { return Scalar(v, text); }
  bool string(string_t& s) override;
  bool binary(binary_t&) override { return Fail(absl::InvalidArgumentError("binary value")); }
  bool start_object(std::size_t) override;
  bool key(string_t& k) override;
  bool end_object() override;
  bool start_array(std::size_t) override;
  bool end_array() override;
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override;

 private:
  // Where a value of the prompt is: none (not in it), the prompt's own value next, an element
  // of its list, an id of one of its inner lists.
  enum PromptState { kNone, kValue, kList, kInner };

  bool Fail(absl::Status s) {
    if (status_.ok()) status_ = std::move(s);
    return false;
  }
  bool Refuse(const std::string& message) { return Fail(absl::InvalidArgumentError(message)); }
  bool Scalar(Json v, const std::string& text);
  // One more value outside the prompt; false (refused) past kMaxFieldValues.
  bool Counted() {
    if (++values_ <= kMaxFieldValues) return true;
    return Refuse(absl::StrCat("the body holds more than ", kMaxFieldValues, " values besides \"",
                               prompt_key_, "\""));
  }
  bool PromptScalar(const std::string& text);
  bool PromptId(int64_t id, const std::string& text);
  // Places `v` in the innermost open container; the placed value.
  Json* Place(Json v);
  std::string Where() const;  // the prompt's element being parsed: "\"prompt\"[3][7]"

  const std::string prompt_key_;
  const int64_t max_tokens_;
  const int max_prompts_;
  RequestBody* out_;
  absl::Status status_;
  std::vector<Json*> stack_;
  std::vector<std::string> keys_;  // per open object: the key of the value that comes next
  int64_t values_ = 0;
  PromptState prompt_ = kNone;
  bool first_ = true;    // no element of the prompt's list yet (it decides single or batch)
  int64_t list_i_ = 0;   // the prompt list's element
  int64_t inner_j_ = 0;  // the inner list's element
};

std::string BodySax::Where() const {
  const std::string name = absl::StrCat("\"", prompt_key_, "\"");
  if (prompt_ == kInner) return absl::StrCat(name, "[", list_i_, "][", inner_j_, "]");
  if (prompt_ == kList) return absl::StrCat(name, "[", list_i_, "]");
  return name;
}

Json* BodySax::Place(Json v) {
  Json& top = *stack_.back();
  if (top.is_array()) {
    top.push_back(std::move(v));
    return &top.back();
  }
  Json& slot = top[keys_.back()];
  slot = std::move(v);
  return &slot;
}

bool BodySax::Scalar(Json v, const std::string& text) {
  if (prompt_ != kNone) return PromptScalar(text.empty() ? v.dump() : text);
  if (stack_.empty()) return Refuse("the body must be a JSON object");
  if (!Counted()) return false;
  Place(std::move(v));
  return true;
}

// null, true, false, a fraction or an object where the prompt wants a text, a list or an id.
bool BodySax::PromptScalar(const std::string& text) {
  if (prompt_ == kValue) {
    return Refuse(absl::StrCat("\"", prompt_key_,
                               "\" must be a text, a non-empty list of token ids, or a list of "
                               "texts or of such lists"));
  }
  if (prompt_ == kList && !first_ && out_->batch) {
    return Refuse(absl::StrCat(Where(), " must be a text or a list of token ids"));
  }
  // A number's text is as long as the client made it (a body of one 60 MB number): shortened.
  const std::string shown = text.size() > 40 ? absl::StrCat(text.substr(0, 40), "...") : text;
  return Refuse(absl::StrCat(Where(), " is ", shown, ", not a token id (a non-negative integer)"));
}

bool BodySax::PromptId(int64_t id, const std::string& text) {
  if (prompt_ == kValue) return PromptScalar(text);
  if (prompt_ == kList) {
    if (first_) out_->prompts.emplace_back(), first_ = false;
    if (out_->batch) return PromptScalar(text);
  }
  if (id < 0 || id > std::numeric_limits<int32_t>::max()) return PromptScalar(text);
  std::vector<int32_t>& ids = out_->prompts.back().ids;
  if (static_cast<int64_t>(ids.size()) >= max_tokens_) {
    const std::string name = out_->batch ? absl::StrCat("\"", prompt_key_, "\"[", list_i_, "]")
                                         : absl::StrCat("\"", prompt_key_, "\"");
    return Fail(absl::ResourceExhaustedError(
        absl::StrCat(name, " holds more than ", max_tokens_,
                     " token ids, the most one prompt may have (--max-batch-tokens)")));
  }
  ids.push_back(static_cast<int32_t>(id));
  ++(prompt_ == kInner ? inner_j_ : list_i_);
  return true;
}

bool BodySax::string(string_t& s) {
  if (prompt_ == kNone) return Scalar(std::move(s), "\"...\"");
  if (prompt_ == kInner || (prompt_ == kList && !first_ && !out_->batch)) {
    return Refuse(absl::StrCat(Where(), " is a text, not a token id (a non-negative integer)"));
  }
  if (prompt_ == kList && static_cast<int64_t>(out_->prompts.size()) >= max_prompts_) {
    return Refuse(absl::StrCat("\"", prompt_key_, "\" holds more than ", max_prompts_, " prompts"));
  }
  out_->prompts.push_back({.text = std::move(s)});
  if (prompt_ == kValue) {
    prompt_ = kNone;
    return true;
  }
  out_->batch = true, first_ = false;
  ++list_i_;
  return true;
}

bool BodySax::start_object(std::size_t) {
  if (prompt_ != kNone) return PromptScalar("an object");
  if (stack_.size() >= kMaxJsonDepth) {
    return Refuse(absl::StrCat("the body nests deeper than ", kMaxJsonDepth, " levels"));
  }
  if (stack_.empty()) {
    stack_.push_back(&out_->fields);
  } else {
    if (!Counted()) return false;
    stack_.push_back(Place(Json::object()));
  }
  keys_.emplace_back();
  return true;
}

bool BodySax::key(string_t& k) {
  // An empty prompt_key_ means "no prompt" (the chat and tokenize bodies): a top-level "" key is
  // then an ordinary field, which the caller refuses as unknown.
  if (stack_.size() == 1 && !prompt_key_.empty() && k == prompt_key_) {
    if (out_->has_prompt) {
      return Refuse(
          absl::StrCat("the body is not valid JSON: object key \"", k, "\" appears twice"));
    }
    out_->has_prompt = true;
    prompt_ = kValue;
    return true;
  }
  if (stack_.back()->contains(k)) {
    return Refuse(absl::StrCat("the body is not valid JSON: object key \"", k, "\" appears twice"));
  }
  keys_.back() = std::move(k);
  return true;
}

bool BodySax::end_object() {
  stack_.pop_back();
  keys_.pop_back();
  return true;
}

bool BodySax::start_array(std::size_t) {
  if (prompt_ == kValue) {
    prompt_ = kList, first_ = true, list_i_ = 0;
    return true;
  }
  if (prompt_ == kInner) return PromptScalar("a list");
  if (prompt_ == kList) {
    if (first_) out_->batch = true, first_ = false;
    if (!out_->batch) return PromptScalar("a list");
    if (static_cast<int64_t>(out_->prompts.size()) >= max_prompts_) {
      return Refuse(
          absl::StrCat("\"", prompt_key_, "\" holds more than ", max_prompts_, " prompts"));
    }
    out_->prompts.emplace_back();
    prompt_ = kInner, inner_j_ = 0;
    return true;
  }
  if (stack_.empty()) return Refuse("the body must be a JSON object");
  if (stack_.size() >= kMaxJsonDepth) {
    return Refuse(absl::StrCat("the body nests deeper than ", kMaxJsonDepth, " levels"));
  }
  if (!Counted()) return false;
  stack_.push_back(Place(Json::array()));
  keys_.emplace_back();
  return true;
}

bool BodySax::end_array() {
  if (prompt_ == kInner) {
    prompt_ = kList;
    if (inner_j_ == 0) return Refuse(absl::StrCat(Where(), ": a list of token ids is empty"));
    out_->prompts.back().ids.shrink_to_fit();  // growth's slack: up to half the capacity
    ++list_i_;
    return true;
  }
  if (prompt_ == kList) {
    if (first_) {
      return Refuse(
          absl::StrCat("\"", prompt_key_, "\" must be a text or a non-empty list of token ids"));
    }
    if (!out_->batch) out_->prompts.back().ids.shrink_to_fit();
    prompt_ = kNone;
    return true;
  }
  stack_.pop_back();
  keys_.pop_back();
  return true;
}

bool BodySax::parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
  // nlohmann's what() opens with "[json.exception.parse_error.101] ": the rest says where.
  std::string what = e.what();
  if (const size_t close = what.find("] "); what.rfind("[json.", 0) == 0 && close != what.npos) {
    what = what.substr(close + 2);
  }
  return Refuse(absl::StrCat("the body is not valid JSON: ", what));
}

}  // namespace

absl::StatusOr<RequestBody> ParseRequestBody(std::string_view body, std::string_view prompt_key,
                                             int64_t max_prompt_tokens, int max_prompts) {
  RequestBody out;
  BodySax sax(prompt_key, max_prompt_tokens, max_prompts, &out);
  bool parsed = false;
  try {
    parsed = Json::sax_parse(body.begin(), body.end(), &sax);
  } catch (const std::exception& e) {  // nlohmann reports through parse_error; a guard only
    return absl::InvalidArgumentError(absl::StrCat("the body is not valid JSON: ", e.what()));
  }
  if (!sax.status().ok()) return sax.status();
  if (!parsed) return absl::InvalidArgumentError("the body is not valid JSON");
  return out;
}

}  // namespace cpfill::launch
