#include "launch/http/http_connections.h"

#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace cpfill::launch {

using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kStreamBufferBytes = 16u << 10;
// A connection closed with input unread is drained this long, or this much, before it is closed:
// closing a socket with unread input resets it, and the reset can reach the client before it
// has read the answer.
constexpr auto kLingerFor = std::chrono::seconds(1);
constexpr int64_t kLingerBytes = 1 << 20;
constexpr auto kWaiterTick = std::chrono::milliseconds(100);
constexpr int kProbeThreads = 2;  // GET /health and /metrics
// glibc's malloc, fixed where it would adapt (mallopt; the process's, rank 0's): blocks of
// kMmapThresholdBytes and more are mapped on their own and unmapped when freed, and a heap's
// free top past kTrimThresholdBytes is given back when a block is freed. Left to adapt, the
// thresholds rise with the first large block freed (to 32 MiB and 64 MiB), after which a burst
// of large bodies stays in the tops of the worker threads' arenas, which malloc_trim does not
// touch (it trims the main arena's top only): measured, 16 bodies of 2 MiB left 55 MB.
constexpr int kMmapThresholdBytes = 1 << 20;
constexpr int kTrimThresholdBytes = 2 << 20;
constexpr int kEpollEvents = 256;

thread_local RequestScope* this_request = nullptr;
thread_local const ConnectionStream* this_connection = nullptr;

enum class Ready { kYes, kTimeout, kStopped };

// Waits until `fd` has `events`, `deadline` passes or `stop_fd` is signalled.
Ready WaitFor(int fd, short events, int stop_fd, Clock::time_point deadline) {
  for (;;) {
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd fds[2] = {{fd, events, 0}, {stop_fd, POLLIN, 0}};
    const int n = ::poll(fds, 2, static_cast<int>(std::clamp<int64_t>(ms, 0, INT_MAX)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Ready::kStopped;
    if (fds[0].revents != 0) return Ready::kYes;  // ready, or an error the next call reports
    if (fds[1].revents != 0) return Ready::kStopped;
    if (Clock::now() >= deadline) return Ready::kTimeout;
  }
}

const char* ReasonPhrase(int status) {
  switch (status) {
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 408:
      return "Request Timeout";
    case 413:
      return "Payload Too Large";
    case 431:
      return "Request Header Fields Too Large";
    default:
      return "Service Unavailable";
  }
}

// An answer written by this layer outside cpp-httplib: small enough for the socket's buffer, so
// the write never waits.
void WriteRefusal(int fd, Refusal why, const std::string& message) {
  const HttpError e = RefusalResponse(why, message);
  const std::string out = absl::StrCat(
      "HTTP/1.1 ", e.status, " ", ReasonPhrase(e.status),
      "\r\nContent-Type: application/json\r\nContent-Length: ", e.body.size(),
      "\r\nConnection: close\r\n", e.status == 503 ? "Retry-After: 1\r\n" : "", "\r\n", e.body);
  [[maybe_unused]] ssize_t n = ::send(fd, out.data(), out.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

// Whether the bytes hold a whole request head. cpp-httplib takes CRLF line ends alone (it skips
// a line ended by a bare line feed), so a head ended otherwise never comes whole: 408.
bool HeadComplete(std::string_view bytes) {
  return bytes.find("\r\n\r\n") != std::string_view::npos;
}

// GET /health and GET /metrics: answered by their own workers, never queued behind completions.
bool IsProbe(std::string_view bytes) {
  for (std::string_view path : {"GET /health", "GET /metrics"}) {
    if (bytes.size() > path.size() && bytes.substr(0, path.size()) == path &&
        (bytes[path.size()] == ' ' || bytes[path.size()] == '?')) {
      return true;
    }
  }
  return false;
}

void IpAndPort(const sockaddr_storage& addr, std::string& ip, int& port) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(addr);
    ::inet_ntop(AF_INET, &a.sin_addr, text, sizeof(text));
    port = ntohs(a.sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(addr);
    ::inet_ntop(AF_INET6, &a.sin6_addr, text, sizeof(text));
    port = ntohs(a.sin6_port);
  }
  ip = text;
}

bool InputLeft(int fd) {
  int bytes = 0;
  return ::ioctl(fd, FIONREAD, &bytes) == 0 && bytes > 0;
}

}  // namespace

bool ByteBudget::TryTake(int64_t bytes) {
  int64_t held = held_.load();
  do {
    if (held + bytes > limit_) return false;
  } while (!held_.compare_exchange_weak(held, held + bytes));
  return true;
}

RequestScope* ThisRequest() { return this_request; }
const ConnectionStream* ThisConnection() { return this_connection; }

bool AnswerRefusal(httplib::Response& res) {
  const RequestScope* scope = this_request;
  if (scope == nullptr || !scope->refusal) return false;
  const HttpError e = RefusalResponse(*scope->refusal, scope->message);
  res.status = e.status;
  res.set_content(e.body, "application/json");
  if (e.status == 503) res.set_header("Retry-After", "1");
  // The connection closes after a body left unread or a head or body that did not come whole.
  if (scope->body_unread || (this_connection != nullptr && this_connection->failed())) {
    res.set_header("Connection", "close");
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// ConnectionStream

ConnectionStream::ConnectionStream(int fd, int stop_fd, const HttpOptions& options,
                                   ByteBudget& budget)
    : fd_(fd), stop_fd_(stop_fd), options_(options), budget_(budget) {}

void ConnectionStream::BeginHead(RequestScope* scope) {
  scope_ = scope;
  phase_ = Phase::kHead;
  head_deadline_ = Clock::now() + options_.head_timeout;
  head_bytes_ = 0;
  body_ = Body::kNone;
  body_limit_ = body_read_ = 0;
  failed_ = false;
}

void ConnectionStream::BeginBody(Body body, uint64_t length) {
  phase_ = Phase::kBody;
  body_ = body;
  body_read_ = 0;
  body_limit_ = body == Body::kLength    ? length
                : body == Body::kChunked ? options_.max_body_bytes
                                         : 0;
}

void ConnectionStream::Shrink() {
  if (begin_ == end_) buffer_.reset(), begin_ = end_ = 0;
}

bool ConnectionStream::PeerGone() const {
  pollfd p{fd_, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

ssize_t ConnectionStream::Fail(Refusal why, std::string message) {
  failed_ = true;
  if (scope_ != nullptr && !scope_->refusal) {
    scope_->refusal = why;
    scope_->message = std::move(message);
  }
  return -1;
}

ssize_t ConnectionStream::Fill(Clock::time_point deadline) {
  if (!buffer_) buffer_ = std::make_unique<char[]>(kStreamBufferBytes);
  begin_ = end_ = 0;
  for (;;) {
    const ssize_t n = ::recv(fd_, buffer_.get(), kStreamBufferBytes, MSG_DONTWAIT);
    if (n >= 0) {
      end_ = static_cast<size_t>(n);
      return n;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      failed_ = true;
      return -1;
    }
    const Ready ready = WaitFor(fd_, POLLIN, stop_fd_, deadline);
    if (ready == Ready::kStopped) {
      failed_ = true;
      return -1;
    }
    if (ready == Ready::kTimeout) {
      return phase_ == Phase::kHead
                 ? Fail(
                       Refusal::kTimeout,
                       absl::StrCat("the request's line and headers did not come within ",
                                    options_.head_timeout.count() / 1e3, " s (--header-timeout-s)"))
                 : Fail(Refusal::kTimeout,
                        absl::StrCat("the body paused longer than ",
                                     options_.read_timeout.count() / 1e3, " s (--read-timeout-s)"));
    }
  }
}

ssize_t ConnectionStream::read(char* ptr, size_t size) {
  if (failed_) return -1;
  if (phase_ == Phase::kBody) {
    if (body_ == Body::kNone) return 0;  // no body: its end at once
    if (body_ == Body::kRefused) return -1;
    if (body_read_ >= body_limit_) {
      if (body_ == Body::kLength) return 0;
      return Fail(Refusal::kBodyTooLarge,
                  absl::StrCat("the chunked body is larger than ", options_.max_body_bytes,
                               " bytes (--max-body-bytes)"));
    }
    size = static_cast<size_t>(std::min<uint64_t>(size, body_limit_ - body_read_));
  }
  if (begin_ == end_) {
    const ssize_t n =
        Fill(phase_ == Phase::kHead ? head_deadline_ : Clock::now() + options_.read_timeout);
    if (n <= 0) return n;
  }
  size = std::min(size, end_ - begin_);
  std::memcpy(ptr, buffer_.get() + begin_, size);
  begin_ += size;
  if (phase_ == Phase::kHead) {
    head_bytes_ += size;
    if (head_bytes_ > kMaxHeadBytes) {
      return Fail(
          Refusal::kHeaderTooLarge,
          absl::StrCat("the request's line and headers are longer than ", kMaxHeadBytes, " bytes"));
    }
  } else {
    body_read_ += size;
    if (body_ == Body::kChunked) {
      if (!budget_.TryTake(static_cast<int64_t>(size))) {
        return Fail(Refusal::kOverloaded,
                    absl::StrCat("the server holds ", budget_.held(),
                                 " bytes of request bodies (--max-pending-bytes ", budget_.limit(),
                                 "); retry later"));
      }
      scope_->taken_bytes += static_cast<int64_t>(size);
    }
  }
  return static_cast<ssize_t>(size);
}

bool ConnectionStream::is_readable() const {
  return begin_ != end_ ||
         WaitFor(fd_, POLLIN, stop_fd_, Clock::now() + options_.read_timeout) == Ready::kYes;
}

// cpp-httplib asks before each chunk of a streamed answer: a client that left ends the stream.
bool ConnectionStream::is_writable() const { return !PeerGone(); }

ssize_t ConnectionStream::write(const char* ptr, size_t size) {
  const auto deadline = Clock::now() + options_.read_timeout;
  for (;;) {
    const ssize_t n = ::send(fd_, ptr, size, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    if (WaitFor(fd_, POLLOUT, stop_fd_, deadline) != Ready::kYes) return -1;
  }
}

void ConnectionStream::get_remote_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) IpAndPort(addr, ip, port);
}

void ConnectionStream::get_local_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) IpAndPort(addr, ip, port);
}

// ---------------------------------------------------------------------------------------------
// A connection and the threads that hold it.

struct Connection {
  Connection(int fd, int stop_fd, const HttpOptions& options, ByteBudget& budget,
             std::atomic<int64_t>& open)
      : fd(fd), stream(fd, stop_fd, options, budget), open_(open) {
    ++open_;
  }
  ~Connection() {
    ::close(fd);
    --open_;
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  const int fd;
  ConnectionStream stream;
  int requests = 0;

 private:
  std::atomic<int64_t>& open_;
};

namespace {

// Threads that answer connections whose head has come, first come first served.
class WorkerPool {
 public:
  WorkerPool(int threads, std::function<void(std::unique_ptr<Connection>)> answer)
      : answer_(std::move(answer)) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
  }
  ~WorkerPool() { Stop(); }

  void Post(std::unique_ptr<Connection> c) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(c));
    }
    ready_.notify_one();
  }

  // Lets each worker end its connection, closes those still queued, joins.
  void Stop() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      queue_.clear();
    }
    ready_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void Work() {
    for (;;) {
      std::unique_ptr<Connection> c;
      {
        std::unique_lock lock(mu_);
        ready_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        c = std::move(queue_.front());
        queue_.pop_front();
      }
      answer_(std::move(c));
    }
  }

  std::function<void(std::unique_ptr<Connection>)> answer_;
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::unique_ptr<Connection>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

// The waiter (one epoll thread holding connections between requests, and closing ones
// lingering), the worker pools, and the idle trim.
class ConnectionHub {
 public:
  enum class Wait { kHead, kKeepAlive, kLinger };

  ConnectionHub(GuardedServer& server, const HttpOptions& options)
      : server_(server),
        options_(options),
        stop_fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
        epoll_fd_(::epoll_create1(EPOLL_CLOEXEC)),
        workers_(options.threads,
                 [this](std::unique_ptr<Connection> c) { server_.Answer(std::move(c), false); }),
        probes_(kProbeThreads,
                [this](std::unique_ptr<Connection> c) { server_.Answer(std::move(c), true); }) {
    epoll_event wake{.events = EPOLLIN, .data = {.fd = stop_fd_}};
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, stop_fd_, &wake);
    waiter_ = std::thread([this] { Loop(); });
  }
  ~ConnectionHub() {
    Stop();
    ::close(epoll_fd_);
    ::close(stop_fd_);
  }

  bool stopping() const { return stopping_; }
  // A connection a probe worker answered whose next request is already buffered.
  void Forward(std::unique_ptr<Connection> c) { workers_.Post(std::move(c)); }
  int64_t open() const { return open_; }
  int64_t trims() const { return trims_; }

  // The listening thread: step 1 of the header comment.
  void Accept(int fd) {
    if (stopping_ || open_ - lingering_ >= options_.max_connections) {
      server_.Count(Refusal::kTooManyConnections);
      WriteRefusal(fd, Refusal::kTooManyConnections,
                   absl::StrCat("the server holds ", options_.max_connections,
                                " connections (--max-connections); retry later"));
      // Counted open while it lingers, never as one of max_connections.
      Close(std::make_unique<Connection>(fd, stop_fd_, options_, server_.budget_, open_),
            /*unread=*/true);
      return;
    }
    Hold(std::make_unique<Connection>(fd, stop_fd_, options_, server_.budget_, open_), Wait::kHead);
  }

  // Any thread: waits for the connection's next head, or (kLinger) for its end.
  void Hold(std::unique_ptr<Connection> c, Wait wait) {
    if (wait != Wait::kLinger) c->stream.Shrink();
    const auto timeout = wait == Wait::kHead        ? options_.head_timeout
                         : wait == Wait::kKeepAlive ? options_.keep_alive_timeout
                                                    : std::chrono::milliseconds(kLingerFor);
    const int fd = c->fd;
    std::lock_guard lock(mu_);
    if (stopping_) return;  // closed as it goes
    if (wait == Wait::kLinger) ++lingering_;
    held_[fd] = {.c = std::move(c), .wait = wait, .deadline = Clock::now() + timeout};
    epoll_event e{.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data = {.fd = fd}};
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &e) != 0) Drop(fd);
  }

  // Closes a connection; one with input left unread lingers first (see kLingerFor).
  void Close(std::unique_ptr<Connection> c, bool unread) {
    if (!(unread || c->stream.buffered() > 0 || InputLeft(c->fd)) ||
        lingering_ >= options_.max_connections) {
      return;  // closed by its destructor
    }
    ::shutdown(c->fd, SHUT_WR);
    Hold(std::move(c), Wait::kLinger);
  }

  // A request (not a probe) ended: the trim waits for trim_after_idle without one.
  void Ended() {
    last_end_ns_ = Clock::now().time_since_epoch().count();
    trim_due_ = true;
  }
  std::atomic<int64_t> busy{0};  // requests being answered

  void Stop() {
    if (stopped_.exchange(true)) return;
    stopping_ = true;
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(stop_fd_, &one, sizeof(one));
    waiter_.join();
    {
      std::lock_guard lock(mu_);
      held_.clear();
    }
    workers_.Stop();
    probes_.Stop();
  }

 private:
  struct Held {
    std::unique_ptr<Connection> c;
    Wait wait = Wait::kHead;
    Clock::time_point deadline;
    int64_t drained = 0;
  };

  // mu_ held.
  void Drop(int fd) {
    auto it = held_.find(fd);
    if (it == held_.end()) return;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    if (it->second.wait == Wait::kLinger) --lingering_;
    held_.erase(it);
  }

  void Loop() {
    std::vector<char> peek(kMaxHeadBytes + 1);
    epoll_event events[kEpollEvents];
    while (!stopping_) {
      const int n =
          ::epoll_wait(epoll_fd_, events, kEpollEvents, static_cast<int>(kWaiterTick.count()));
      {
        std::lock_guard lock(mu_);
        for (int i = 0; i < n; ++i) {
          if (events[i].data.fd == stop_fd_) continue;
          auto it = held_.find(events[i].data.fd);
          if (it != held_.end()) OnInput(it, events[i].events, peek);
        }
        Expire();
      }
      TrimIfIdle();  // not under mu_: a trim can take milliseconds
    }
  }

  // mu_ held: input on a held connection.
  void OnInput(std::map<int, Held>::iterator it, uint32_t events, std::vector<char>& peek) {
    Held& h = it->second;
    const int fd = it->first;
    if (h.wait == Wait::kLinger) {
      for (;;) {  // discard until the client's end, an error, or the linger's bound
        const ssize_t got = ::recv(fd, peek.data(), peek.size(), MSG_DONTWAIT);
        if (got > 0 && (h.drained += got) < kLingerBytes) continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        return Drop(fd);
      }
    }
    // What the stream read ahead (a pipelined head's start), then what the socket holds.
    const std::string_view ahead = h.c->stream.Buffered();
    std::copy(ahead.begin(), ahead.end(), peek.begin());
    const ssize_t got =
        ::recv(fd, peek.data() + ahead.size(), peek.size() - ahead.size(), MSG_PEEK | MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (got <= 0) return Drop(fd);  // the client closed (between requests: a normal end)
    const std::string_view bytes(peek.data(), ahead.size() + static_cast<size_t>(got));
    if (HeadComplete(bytes)) {
      std::unique_ptr<Connection> c = std::move(h.c);
      Drop(fd);
      (IsProbe(bytes) ? probes_ : workers_).Post(std::move(c));
      return;
    }
    if (bytes.size() > kMaxHeadBytes) {
      return Refuse(
          it, Refusal::kHeaderTooLarge,
          absl::StrCat("the request's line and headers are longer than ", kMaxHeadBytes, " bytes"));
    }
    if ((events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0) return Drop(fd);  // a part, then gone
    if (h.wait == Wait::kKeepAlive) {  // the next request has begun: its head's deadline
      h.wait = Wait::kHead;
      h.deadline = Clock::now() + options_.head_timeout;
    }
  }

  // mu_ held: answers a held connection's refusal, then lets it linger.
  void Refuse(std::map<int, Held>::iterator it, Refusal why, const std::string& message) {
    server_.Count(why);
    Held& h = it->second;
    WriteRefusal(it->first, why, message);
    ::shutdown(it->first, SHUT_WR);
    h.wait = Wait::kLinger;
    h.deadline = Clock::now() + kLingerFor;
    ++lingering_;
  }

  // mu_ held: deadlines. An idle keep-alive connection is closed quietly; one whose head has
  // begun and stalled is answered 408.
  void Expire() {
    const auto now = Clock::now();
    if (now < next_expiry_) return;
    next_expiry_ = now + kWaiterTick;
    std::vector<int> expired;
    for (auto& [fd, h] : held_) {
      if (now >= h.deadline) expired.push_back(fd);
    }
    for (const int fd : expired) {
      auto it = held_.find(fd);
      if (it->second.wait != Wait::kHead ||
          (it->second.c->stream.buffered() == 0 && !InputLeft(fd))) {
        Drop(fd);
        continue;
      }
      Refuse(it, Refusal::kTimeout,
             absl::StrCat("the request's line and headers did not come within ",
                          options_.head_timeout.count() / 1e3, " s (--header-timeout-s)"));
    }
  }

  // Once no request has been answered for trim_after_idle, the memory a burst freed goes back
  // to the system: glibc keeps freed heap pages of every thread's arena otherwise.
  void TrimIfIdle() {
    if (!trim_due_ || busy > 0) return;  // (a probe being answered only delays it a tick)
    const auto idle = Clock::now().time_since_epoch().count() - last_end_ns_;
    if (idle < std::chrono::nanoseconds(options_.trim_after_idle).count()) return;
    trim_due_ = false;
    ::malloc_trim(0);
    ++trims_;
  }

  GuardedServer& server_;
  const HttpOptions& options_;
  const int stop_fd_, epoll_fd_;
  std::atomic<bool> stopping_{false}, stopped_{false}, trim_due_{false};
  std::atomic<int64_t> open_{0}, lingering_{0}, trims_{0}, last_end_ns_{0};
  std::mutex mu_;
  std::map<int, Held> held_;  // guarded by mu_
  Clock::time_point next_expiry_{};
  WorkerPool workers_, probes_;
  std::thread waiter_;
};

// cpp-httplib's task queue: the listening thread hands each accepted socket to the hub at once
// (process_and_close_socket returns without waiting).
class InlineQueue final : public httplib::TaskQueue {
 public:
  explicit InlineQueue(GuardedServer& server) : server_(server) { server_.Start(); }
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override { server_.Stop(); }

 private:
  GuardedServer& server_;
};

// ---------------------------------------------------------------------------------------------
// GuardedServer

GuardedServer::GuardedServer(HttpOptions options)
    : options_(std::move(options)), budget_(static_cast<int64_t>(options_.max_pending_bytes)) {
  new_task_queue = [this] { return new InlineQueue(*this); };
  set_payload_max_length(options_.max_body_bytes);
  set_keep_alive_max_count(static_cast<size_t>(options_.keep_alive_requests));
  set_keep_alive_timeout(
      std::chrono::ceil<std::chrono::seconds>(options_.keep_alive_timeout).count());
  set_pre_routing_handler([](const httplib::Request&, httplib::Response& res) {
    return AnswerRefusal(res) ? HandlerResponse::Handled : HandlerResponse::Unhandled;
  });
  // A refused request is answered before the client sends its body ("100 Continue" never comes).
  set_expect_100_continue_handler([](const httplib::Request&, httplib::Response& res) {
    return AnswerRefusal(res) ? res.status : 100;
  });
}

GuardedServer::~GuardedServer() { Stop(); }

void GuardedServer::Start() {
  if (hub_) return;
  // cpp-httplib listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG): a burst of connections
  // past it waits for the kernel to resend its SYN-ACK (a second or more). Listening again sets
  // a backlog as deep as the connections held at once (the kernel caps it at somaxconn).
  ::listen(svr_sock_, std::max(options_.max_connections, 128));
  ::mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
  ::mallopt(M_TRIM_THRESHOLD, kTrimThresholdBytes);
  hub_ = std::make_unique<ConnectionHub>(*this, options_);
}

void GuardedServer::Stop() {
  if (hub_) hub_->Stop();
}

void GuardedServer::Fill(ServerCounters* counters) const {
  for (int i = 0; i < kRefusalKinds; ++i) {
    counters->refused[static_cast<size_t>(i)] = refused_[static_cast<size_t>(i)];
  }
  counters->connections_open = hub_ ? hub_->open() : 0;
  counters->pending_bytes = budget_.held();
  counters->memory_trims = hub_ ? hub_->trims() : 0;
}

bool GuardedServer::process_and_close_socket(int sock) {
  hub_->Accept(sock);
  return true;
}

void GuardedServer::Answer(std::unique_ptr<Connection> c, bool probe) {
  for (;;) {
    RequestScope scope;
    c->stream.BeginHead(&scope);
    const bool last = ++c->requests >= options_.keep_alive_requests || hub_->stopping();
    bool client_closes = false;
    this_request = &scope;
    this_connection = &c->stream;
    ++hub_->busy;
    const bool answered =
        process_request(c->stream, last, client_closes,
                        [&](httplib::Request& req) { Admit(req, c->stream, scope); });
    --hub_->busy;
    this_request = nullptr;
    this_connection = nullptr;
    budget_.Give(scope.taken_bytes);
    if (!probe) hub_->Ended();  // a monitor's polls do not keep the server from being idle
    const bool unread = scope.body_unread || c->stream.failed();
    if (!answered || last || client_closes || unread || hub_->stopping()) {
      return hub_->Close(std::move(c), unread);
    }
    // Pipelined: the next request, in order, once its head is whole; a part of one waits for
    // the rest without a worker.
    if (HeadComplete(c->stream.Buffered())) {
      if (probe) return hub_->Forward(std::move(c));  // probe workers answer probes alone
      continue;
    }
    const bool begun = c->stream.buffered() > 0;
    return hub_->Hold(std::move(c),
                      begun ? ConnectionHub::Wait::kHead : ConnectionHub::Wait::kKeepAlive);
  }
}

namespace {

bool OpenRoute(const std::string& path) { return path == "/health" || path == "/metrics"; }

}  // namespace

// Refusals in the order a client should learn of them: without the key, nothing about the
// server's limits.
void GuardedServer::Admit(httplib::Request& req, ConnectionStream& stream, RequestScope& scope) {
  const auto refuse = [&](Refusal why, std::string message) {
    if (scope.refusal) return;
    scope.refusal = why;
    scope.message = std::move(message);
  };
  if (!options_.api_key.empty() && !OpenRoute(req.path)) {
    const std::string authorization = req.get_header_value("Authorization");
    if (authorization.empty()) {
      refuse(Refusal::kUnauthorized,
             "this server needs an API key: send the header \"Authorization: Bearer <key>\"");
    } else if (!BearerKeyMatches(authorization, options_.api_key)) {
      refuse(Refusal::kUnauthorized, "the API key is not valid");
    }
  }
  const std::string encoding = req.get_header_value("Transfer-Encoding");
  const bool chunked = absl::EqualsIgnoreCase(encoding, "chunked");
  const size_t lengths = req.get_header_value_count("Content-Length");
  uint64_t length = 0;
  if (!encoding.empty() && !chunked) {
    refuse(Refusal::kBadRequest,
           absl::StrCat("Transfer-Encoding \"", encoding, "\": only \"chunked\" is taken"));
  } else if (chunked && lengths > 0) {
    refuse(Refusal::kBadRequest, "both Content-Length and Transfer-Encoding: give one");
  } else if (lengths > 1) {
    refuse(Refusal::kBadRequest, "more than one Content-Length");
  } else if (lengths == 1) {
    const std::string text = req.get_header_value("Content-Length");
    if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos ||
        !absl::SimpleAtoi(text, &length)) {
      refuse(Refusal::kBadRequest, absl::StrCat("Content-Length \"", text, "\" is not a size"));
      length = 0;
    }
  }
  if (length > options_.max_body_bytes) {
    refuse(Refusal::kBodyTooLarge,
           absl::StrCat("the body (", length, " bytes) is larger than ", options_.max_body_bytes,
                        " bytes (--max-body-bytes)"));
  } else if (!scope.refusal && length > 0) {
    if (budget_.TryTake(static_cast<int64_t>(length))) {
      scope.taken_bytes = static_cast<int64_t>(length);
    } else {
      refuse(Refusal::kOverloaded,
             absl::StrCat("the server holds ", budget_.held(), " bytes of request bodies ",
                          "(--max-pending-bytes ", budget_.limit(), "); retry later"));
    }
  }
  const bool has_body = chunked || length > 0 || lengths > 1;
  if (scope.refusal) {
    scope.body_unread = has_body || !encoding.empty();
    stream.BeginBody(ConnectionStream::Body::kRefused, 0);
    return;
  }
  stream.BeginBody(chunked      ? ConnectionStream::Body::kChunked
                   : length > 0 ? ConnectionStream::Body::kLength
                                : ConnectionStream::Body::kNone,
                   length);
}

}  // namespace cpfill::launch
