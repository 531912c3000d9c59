#include "runtime/serving/step_wire.h"

#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace cpfill::runtime {
namespace {

class Writer {
 public:
  void U32(uint32_t x) { Raw(&x, 4); }
  void U64(uint64_t x) { Raw(&x, 8); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    Raw(s.data(), s.size());
  }
  void Ids(const std::vector<int32_t>& ids) {
    U32(static_cast<uint32_t>(ids.size()));
    Raw(ids.data(), ids.size() * 4);
  }
  void Draw(const std::optional<TokenDraw>& d) {
    U32(d.has_value());
    if (!d.has_value()) return;
    Raw(&d->params.temperature, 8);
    U32(static_cast<uint32_t>(d->params.top_k));
    Raw(&d->params.top_p, 8);
    U64(d->params.seed);
    U64(d->step);
  }
  void Forks(const std::vector<StepPlan::Fork>& forks) {
    U32(static_cast<uint32_t>(forks.size()));
    for (const StepPlan::Fork& f : forks) {
      Str(f.parent);
      Str(f.child);
      U64(f.tokens);
    }
  }
  std::vector<char> bytes;

 private:
  void Raw(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    bytes.insert(bytes.end(), c, c + n);
  }
};

class Reader {
 public:
  explicit Reader(const std::vector<char>& bytes) : bytes_(bytes) {}
  bool U32(uint32_t* x) { return Raw(x, 4); }
  bool U64(uint64_t* x) { return Raw(x, 8); }
  bool Str(std::string* s) {
    uint32_t n = 0;
    if (!U32(&n) || n > left()) return false;
    s->assign(bytes_.data() + at_, n);
    at_ += n;
    return true;
  }
  bool Draw(std::optional<TokenDraw>* d) {
    uint32_t has = 0, top_k = 0;
    if (!U32(&has) || has > 1) return false;
    if (has == 0) return true;
    TokenDraw& x = d->emplace();
    if (!Raw(&x.params.temperature, 8) || !U32(&top_k) || !Raw(&x.params.top_p, 8)) return false;
    x.params.top_k = static_cast<int>(top_k);
    return U64(&x.params.seed) && U64(&x.step);
  }
  bool Ids(std::vector<int32_t>* ids) {
    uint32_t n = 0;
    if (!U32(&n) || uint64_t{n} * 4 > left()) return false;
    ids->resize(n);
    return Raw(ids->data(), uint64_t{n} * 4);
  }
  bool Forks(std::vector<StepPlan::Fork>* forks) {
    uint32_t n = 0;
    bool ok = U32(&n);
    for (uint32_t i = 0; ok && i < n; ++i) {
      StepPlan::Fork& f = forks->emplace_back();
      ok = Str(&f.parent) && Str(&f.child) && U64(&f.tokens);
    }
    return ok;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  size_t left() const { return bytes_.size() - at_; }
  bool Raw(void* p, size_t n) {
    if (n > left()) return false;
    if (n > 0) std::memcpy(p, bytes_.data() + at_, n);
    at_ += n;
    return true;
  }
  const std::vector<char>& bytes_;
  size_t at_ = 0;
};

}  // namespace

std::vector<char> StepToWire(const StepPlan& plan) {
  Writer w;
  w.U32(plan.kind);
  w.U64(plan.step);
  w.U32(static_cast<uint32_t>(plan.end_sessions.size()));
  for (const std::string& s : plan.end_sessions) w.Str(s);
  w.U32(static_cast<uint32_t>(plan.batch.size()));
  for (const PrefillRequest& r : plan.batch) {
    w.Str(r.session);
    w.Ids(r.tokens);
    w.Draw(r.draw);
    w.U32(static_cast<uint32_t>(r.prompt_logprobs));  // -1 (none) travels as 0xffffffff
    // SparQ: 0 (dense) or 1 then r, k, l, oracle.
    w.U32(r.sparq.has_value() ? 1 : 0);
    if (r.sparq.has_value()) {
      for (int x : {r.sparq->r, r.sparq->k, r.sparq->local_window, int{r.sparq->oracle}}) {
        w.U32(static_cast<uint32_t>(x));
      }
    }
  }
  w.U32(static_cast<uint32_t>(plan.publish.size()));
  for (const StepPlan::Publish& p : plan.publish) {
    w.Str(p.kv_name);
    w.Str(p.request_id);
    w.U32(p.slot);
    w.U64(p.nonce.hi);
    w.U64(p.nonce.lo);
  }
  w.Forks(plan.forks);
  w.Forks(plan.keeps);
  return std::move(w.bytes);
}

absl::StatusOr<StepPlan> StepFromWire(const std::vector<char>& bytes) {
  StepPlan c;
  Reader r(bytes);
  uint32_t kind = 0, n = 0;
  bool ok = r.U32(&kind) && kind <= StepPlan::kShutdown && r.U64(&c.step) && r.U32(&n);
  for (uint32_t i = 0; ok && i < n; ++i) ok = r.Str(&c.end_sessions.emplace_back());
  ok = ok && r.U32(&n);
  for (uint32_t i = 0; ok && i < n; ++i) {
    PrefillRequest& req = c.batch.emplace_back();
    uint32_t prompt_logprobs = 0;
    ok = r.Str(&req.session) && r.Ids(&req.tokens) && r.Draw(&req.draw) &&
         r.U32(&prompt_logprobs);
    req.prompt_logprobs = static_cast<int32_t>(prompt_logprobs);
    ok = ok && req.prompt_logprobs >= -1 && req.prompt_logprobs <= 1024;
    uint32_t sparq = 0, f[4] = {};
    ok = ok && r.U32(&sparq) && sparq <= 1;
    if (ok && sparq == 1) {
      ok = r.U32(&f[0]) && r.U32(&f[1]) && r.U32(&f[2]) && r.U32(&f[3]);
      req.sparq = attention::sparq::SparqConfig{.r = static_cast<int>(f[0]),
                                                .k = static_cast<int>(f[1]),
                                                .local_window = static_cast<int>(f[2]),
                                                .oracle = f[3] != 0};
    }
  }
  ok = ok && r.U32(&n);
  for (uint32_t i = 0; ok && i < n; ++i) {
    StepPlan::Publish& p = c.publish.emplace_back();
    ok = r.Str(&p.kv_name) && r.Str(&p.request_id) && r.U32(&p.slot) && r.U64(&p.nonce.hi) &&
         r.U64(&p.nonce.lo);
  }
  ok = ok && r.Forks(&c.forks) && r.Forks(&c.keeps);
  if (!ok || !r.done()) {
    return absl::InternalError(
        absl::StrCat("engine: a malformed command of ", bytes.size(), " bytes from world rank 0"));
  }
  c.kind = static_cast<StepPlan::Kind>(kind);
  return c;
}

}  // namespace cpfill::runtime
