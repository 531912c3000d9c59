#include "launch/http/chat_renderer.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace cpfill::launch {
namespace {

int MsLeft(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

absl::Status Unavailable(const std::string& command, const std::string& why) {
  return absl::UnavailableError(absl::StrCat("the chat template renderer (", command, ") ", why,
                                             "; it is restarted for the next request"));
}

}  // namespace

ChatRenderer::~ChatRenderer() {
  std::lock_guard lock(mu_);
  StopLocked();
}

// One socket pair is the child's stdin and stdout: send() with MSG_NOSIGNAL cannot raise SIGPIPE
// in the server when the child has died. posix_spawn, not fork: rank 0 is a threaded MPI process.
absl::Status ChatRenderer::StartLocked() {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return Unavailable(options_.command, absl::StrCat("got no socket pair: ", strerror(errno)));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  // The server's sockets (the listening one, clients') must not live on in the child.
  posix_spawn_file_actions_addclosefrom_np(&actions, STDERR_FILENO + 1);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);  // its own group: killed as a whole
  posix_spawnattr_setpgroup(&attr, 0);
  const std::string exec = "exec " + options_.command;
  char* argv[] = {const_cast<char*>("/bin/sh"), const_cast<char*>("-c"),
                  const_cast<char*>(exec.c_str()), nullptr};
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, "/bin/sh", &actions, &attr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(fds[1]);
  if (spawned != 0) {
    close(fds[0]);
    return Unavailable(options_.command, absl::StrCat("cannot start: ", strerror(spawned)));
  }
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  pid_ = pid;
  fd_ = fds[0];
  buffer_.clear();
  if (started_++ > 0) ++restarts_;
  return absl::OkStatus();
}

void ChatRenderer::StopLocked() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  if (pid_ > 0) {
    kill(-pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);  // SIGKILL: reaped at once
  }
  pid_ = -1;
}

absl::Status ChatRenderer::SendLocked(const std::string& line,
                                      std::chrono::steady_clock::time_point deadline) {
  size_t sent = 0;
  while (sent < line.size()) {
    const ssize_t n = send(fd_, line.data() + sent, line.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return Unavailable(options_.command, absl::StrCat("is gone: ", strerror(errno)));
    }
    pollfd p{.fd = fd_, .events = POLLOUT};
    if (poll(&p, 1, MsLeft(deadline)) == 0) {
      return Unavailable(options_.command, "did not read the request in time");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ChatRenderer::ReceiveLocked(
    std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    if (const size_t end = buffer_.find('\n'); end != std::string::npos) {
      std::string line = buffer_.substr(0, end);
      buffer_.erase(0, end + 1);
      return line;
    }
    if (buffer_.size() > options_.max_output_bytes) {
      return Unavailable(options_.command,
                         absl::StrCat("answered more than ", options_.max_output_bytes, " bytes"));
    }
    pollfd p{.fd = fd_, .events = POLLIN};
    const int ready = poll(&p, 1, MsLeft(deadline));
    if (ready == 0) {
      return Unavailable(options_.command,
                         absl::StrCat("did not answer within ", options_.timeout.count(), " ms"));
    }
    char chunk[65536];
    const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
    if (n == 0) return Unavailable(options_.command, "exited");
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return Unavailable(options_.command, absl::StrCat("is gone: ", strerror(errno)));
    }
    if (n > 0) buffer_.append(chunk, static_cast<size_t>(n));
  }
}

// 1. start the co-process if none runs; 2. send the request's line; 3. read one line back,
// all under one deadline; any failure of the co-process kills it (the next call restarts it).
absl::StatusOr<std::string> ChatRenderer::Render(const nlohmann::json& request) {
  std::lock_guard lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  // One that died since the last call is replaced before this request is sent, not after.
  if (pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == pid_) {
    pid_ = -1;  // reaped
    StopLocked();
  }
  // Bytes that came after the last answer (a renderer that wrote two lines for one request, or
  // wrote late) would be read as this request's answer: another request's prompt. Such a
  // co-process is out of step and is replaced. (Readable also when it closed its end.)
  if (fd_ >= 0) {
    pollfd p{.fd = fd_, .events = POLLIN};
    if (!buffer_.empty() || poll(&p, 1, 0) > 0) StopLocked();
  }
  if (fd_ < 0) {
    if (absl::Status started = StartLocked(); !started.ok()) return started;
  }
  const absl::Status sent = SendLocked(
      request.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", deadline);
  absl::StatusOr<std::string> line =
      sent.ok() ? ReceiveLocked(deadline) : absl::StatusOr<std::string>(sent);
  if (line.ok() && line->empty()) line = Unavailable(options_.command, "answered nothing");
  nlohmann::json answer = line.ok()
                              ? nlohmann::json::parse(*line, nullptr, /*allow_exceptions=*/false)
                              : nlohmann::json();
  if (line.ok() && answer.is_object() && answer.contains("prompt") &&
      answer["prompt"].is_string()) {
    return answer["prompt"].get<std::string>();
  }
  if (line.ok() && answer.is_object() && answer.contains("error") && answer["error"].is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("\"messages\": the chat template refused them: ",
                                                   answer["error"].get<std::string>()));
  }
  StopLocked();
  if (!line.ok()) return line.status();
  return Unavailable(options_.command, "answered neither {\"prompt\"} nor {\"error\"}");
}

}  // namespace cpfill::launch
