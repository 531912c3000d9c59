#!/usr/bin/env python3
"""The Slurm job scripts (launch/slurm/) on a real Slurm, started here (standard library only).

    python3 tests/slurm/slurm_test.py build/cpfill [--keep]

Starts munged, slurmctld and slurmd on 127.0.0.1 with a test-only configuration in a temporary
folder (one node, node1, with 4 GPUs that are /dev/null, so --gpus-per-node works as on a GPU
cluster; MpiDefault=none, so the scripts' own `srun --mpi=pmix` is what starts the ranks), waits
for the node to be idle, then submits the scripts as a user would, on the CPU backend with 4 ranks
in 2 emulated nodes of 2 (CPFILL_BACKEND=cpu, CPFILL_RANKS_PER_NODE=2):
  * `sbatch --wait --gpus-per-node=4 cpfill-attention.sbatch ... --check`: exit 0, TP2 x CP2
    chosen from the 4 KV heads and printed with the node list, one world of 4 ranks (not 4
    singletons), the check passes, srun warns of nothing;
  * `cpfill-prefill.sbatch --model tiny --check` with TASKS_PER_NODE=4 and --gpus-per-node=0
    (the CPU set-up): the same;
  * `cpfill-serve.sbatch --model tiny`, twice: a completion over HTTP, then
    `scancel --signal=TERM` (rank 0 drains, the job completes with exit 0) or a plain `scancel`;
    either way every rank exits within 20 s (before Slurm's KillWait of 30 s would kill them);
  * a bad flag: sbatch --wait exits non-zero, cpfill's one message appears once;
  * a Slurm without the PMIx plugin (a stand-in srun): exit 2 and a message saying what to
    install.
Every daemon it started is stopped on every way out, and no process it started is left (checked
by a marker in their environment). Exits 77 (skipped) when not root or when Slurm or munge is not
installed (launch/setup.sh installs them).
"""
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPTS = os.path.join(ROOT, "launch", "slurm")
NODE = "node1"
GPUS = 4
KILL_WAIT_S = 30  # slurm.conf's KillWait: SIGTERM, then SIGKILL this much later
PROGRAMS = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue",
            "scancel"]
# The daemons live in sbin, which a non-login root's PATH may lack.
SEARCH_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


def program(name):
    return shutil.which(name, path=SEARCH_PATH)


class Failure(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Failure(msg)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent():
    """preexec_fn: the daemon gets SIGTERM if this test dies without cleaning up."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


SLURM_CONF = """\
# Test-only: one node on 127.0.0.1, everything in {tmp}; no cgroups, no systemd, no accounting.
ClusterName=cpfilltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={tmp}/munge.sock
CredType=cred/munge
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
TmpFS={tmp}
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait={kill_wait}
# Two CPUs whatever the machine has: four ranks outnumber them, as on a 2-core CI machine.
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName={node} NodeHostname={hostname} NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:{gpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """munged, slurmctld and slurmd in `tmp`, stopped by stop()."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.procs = []  # (name, Popen)
        self.marker = f"CPFILL_SLURM_TEST_DIR={tmp}"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env.update(SLURM_CONF=f"{tmp}/slurm.conf", CPFILL_SLURM_TEST_DIR=tmp)
        self.env = env

    def write_config(self):
        for d in ("state", "spool"):
            os.mkdir(os.path.join(self.tmp, d), 0o700)
        key = os.path.join(self.tmp, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        # The node's GPUs: character devices to Slurm, nothing to anyone else.
        for i in range(GPUS):
            os.symlink("/dev/null", os.path.join(self.tmp, f"gpu{i}"))
        with open(os.path.join(self.tmp, "gres.conf"), "w") as f:
            f.write(f"NodeName={NODE} Name=gpu File={self.tmp}/gpu[0-{GPUS - 1}]\n")
        with open(os.path.join(self.tmp, "slurm.conf"), "w") as f:
            f.write(SLURM_CONF.format(tmp=self.tmp, ctld_port=free_port(),
                                      slurmd_port=free_port(), kill_wait=KILL_WAIT_S, node=NODE,
                                      hostname=socket.gethostname(), gpus=GPUS))

    def start(self, name, argv):
        log = open(os.path.join(self.tmp, f"{name}.out"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                             stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self.procs.append((name, p))
        return p

    def run(self, argv, timeout=30, **kw):
        return subprocess.run(argv, env=kw.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def up(self):
        t = self.tmp
        self.start("munged", [program("munged"), "-F", f"--socket={t}/munge.sock",
                              f"--key-file={t}/munge.key", f"--pid-file={t}/munged.pid",
                              f"--seed-file={t}/munged.seed", f"--log-file={t}/munged.log"])
        wait_for(lambda: os.path.exists(f"{t}/munge.sock"), 10, "munged's socket", self)
        self.start("slurmctld", [program("slurmctld"), "-D", "-f", f"{t}/slurm.conf"])
        self.start("slurmd", [program("slurmd"), "-D", "-N", NODE, "-f", f"{t}/slurm.conf"])

        def idle():
            r = self.run(["sinfo", "-h", "-n", NODE, "-o", "%T"], timeout=10)
            return r.returncode == 0 and r.stdout.strip() == "idle"
        wait_for(idle, 30, f"{NODE} idle in sinfo", self)

    def jobs(self):
        r = self.run(["squeue", "-h", "-o", "%i"], timeout=10)
        return r.stdout.split() if r.returncode == 0 else []

    def marked_pids(self):
        """Processes this test started (the marker is in their environment), but not itself."""
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if self.marker.encode() not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            found.append((int(pid), cmd))
        return found

    def stop(self):
        """Cancels the jobs, stops the daemons; returns what was left behind and had to be
        killed."""
        try:
            if any(p.poll() is None for _, p in self.procs) and self.jobs():
                self.run(["scancel", "--full", *self.jobs()], timeout=10)
                deadline = time.time() + KILL_WAIT_S + 15
                while self.jobs() and time.time() < deadline:
                    time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for _, p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        left = self.marked_pids()
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return left

    def logs(self):
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.out", "slurmctld.out", "slurmd.out"):
            path = os.path.join(self.tmp, name)
            if os.path.exists(path):
                lines = open(path, errors="replace").readlines()[-15:]
                out.append(f"---- {name} (last {len(lines)} lines) ----\n" + "".join(lines))
        return "\n".join(out)


def wait_for(cond, seconds, what, cluster=None):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if cluster is not None:
            for name, p in cluster.procs:
                if p.poll() is not None:
                    raise Failure(f"{name} exited ({p.returncode}) while waiting for {what}")
        if cond():
            return
        time.sleep(0.2)
    raise Failure(f"no {what} after {seconds} s")


def sbatch_wait(cluster, env, out, script, sbatch_flags, args, timeout=240):
    """sbatch --wait; returns (exit status, the job's output)."""
    r = cluster.run(["sbatch", "--wait", f"--output={out}", *sbatch_flags,
                     os.path.join(SCRIPTS, script), *args], env=env, timeout=timeout,
                    cwd=cluster.tmp)
    text = open(out, errors="replace").read() if os.path.exists(out) else ""
    print(f"$ sbatch --wait {' '.join(sbatch_flags)} {script} {' '.join(args)}: exit "
          f"{r.returncode}\n{text}{r.stderr}", flush=True)
    return r.returncode, text


def assert_clean_run(text, command, layout, quiet=True):
    """What every passing job prints: the layout the script chose, the node list, one world of
    4 ranks in that layout (not 4 singletons), and (quiet) no word from srun or Slurm."""
    check(re.search(f"^cpfill-slurm: cpfill {command} on 1 node\\(s\\) x 4 rank\\(s\\), cpu "
                    f"backend: {layout}( |$)", text, re.M),
          f"the script did not print the layout '{layout}'")
    check(f"cpfill-slurm: nodes: {NODE}\n" in text, "the script did not print the node list")
    # cpfill's own layout line ("grid: world 4 = ..."; serve: "cpfill serve: tiny on ... (world 4")
    grids = re.findall(r"^(?:grid: |cpfill serve: .*\()world (\d+) = [^;]*; (TP\d+ x CP\d+) ",
                       text, re.M)
    check(grids == [("4", layout)], f"expected one world of 4 ranks in {layout}, got {grids}")
    if quiet:
        noise = [l for l in text.splitlines() if l.startswith(("srun:", "slurmstepd"))
                 or "warning" in l.lower()]
        check(not noise, f"srun or Slurm complained: {noise}")


def case_attention(cluster, env):
    code, text = sbatch_wait(cluster, env, f"{cluster.tmp}/attention.out",
                             "cpfill-attention.sbatch", ["--gpus-per-node=4"],
                             ["--seq-lens", "1024,300", "--heads", "8", "--kv-heads", "4",
                              "--head-dim", "32", "--check", "--timeout-s", "60"])
    check(code == 0, f"attention job exited {code}")
    assert_clean_run(text, "attention", "TP2 x CP2")
    check("cpfill-slurm: TP2: the largest divisor of the 4 KV head(s) that divides the 2 rank(s) "
          "of a node\n" in text, "the script did not say why TP2")
    check(re.search(r"^check: .*: PASS$", text, re.M), "attention --check did not pass")


def case_prefill(cluster, env):
    env = dict(env, TASKS_PER_NODE="4")
    code, text = sbatch_wait(cluster, env, f"{cluster.tmp}/prefill.out", "cpfill-prefill.sbatch",
                             ["--gpus-per-node=0"],
                             ["--model", "tiny", "--prompt-lens", "200,500", "--check",
                              "--timeout-s", "60"])
    check(code == 0, f"prefill job exited {code}")
    assert_clean_run(text, "prefill", "TP2 x CP2")
    check("GPU(s) per node" in text, "the script did not print the GPUs per node")
    check(re.search(r"^check: .*PASS", text, re.M), "prefill --check did not pass")


def serve_ranks(cluster, cpfill):
    """The pids of the `cpfill serve` ranks this test started."""
    ranks = []
    for pid, cmd in cluster.marked_pids():
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if exe == os.path.realpath(cpfill) and cmd.split()[1:2] == ["serve"]:
            ranks.append(pid)
    return ranks


def case_serve(cluster, env, drain):
    """The serve script answers a completion; then `scancel --signal=TERM` (drain: rank 0 drains,
    every rank exits 0, the job completes) or a plain `scancel` (every rank ends at once)."""
    tmp = cluster.tmp
    name = "serve-drain" if drain else "serve-scancel"
    out, port_file = f"{tmp}/{name}.out", f"{tmp}/{name}.port"
    r = cluster.run(["sbatch", "--parsable", f"--output={out}", "--gpus-per-node=4",
                     os.path.join(SCRIPTS, "cpfill-serve.sbatch"), "--model", "tiny",
                     "--port", "0", "--port-file", port_file, "--kv-capacity-tokens", "8192",
                     "--timeout-s", "60"], env=env, cwd=tmp)
    check(r.returncode == 0, f"sbatch of the serve job failed: {r.stderr}")
    job = r.stdout.strip().split(";")[0]

    def log():
        return open(out, errors="replace").read() if os.path.exists(out) else ""

    def listening():
        check(job in cluster.jobs(), f"the serve job {job} ended before it listened:\n{log()}")
        return os.path.exists(port_file) and open(port_file).read().strip()
    wait_for(listening, 60, "the port file of the serve job", cluster)
    port = int(open(port_file).read())
    body = json.dumps({"prompt": [1, 17, 250, 3], "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        status, answer = resp.status, json.loads(resp.read())
    print(f"POST /v1/completions: {status} {json.dumps(answer)[:200]}", flush=True)
    check(status == 200 and answer["usage"]["prompt_tokens"] == 4 and answer["choices"],
          f"unexpected answer {answer}")
    ranks = serve_ranks(cluster, env["CPFILL"])
    check(len(ranks) == 4, f"expected 4 cpfill serve ranks, found {len(ranks)}")

    scancel = ["scancel", "--signal=TERM", job] if drain else ["scancel", job]
    start = time.time()
    check(cluster.run(scancel).returncode == 0, f"{' '.join(scancel)} failed")
    # Before Slurm's KillWait would SIGKILL them: the ranks end by themselves.
    while serve_ranks(cluster, env["CPFILL"]) and time.time() < start + KILL_WAIT_S - 10:
        time.sleep(0.2)
    left, took = serve_ranks(cluster, env["CPFILL"]), time.time() - start
    wait_for(lambda: job not in cluster.jobs(), KILL_WAIT_S + 15, f"job {job} to end")
    text = log()
    print(f"$ sbatch cpfill-serve.sbatch; {' '.join(scancel)}: ranks gone after {took:.1f} s\n"
          f"{text}", flush=True)
    check(not left, f"cpfill serve ranks {left} still running {took:.0f} s after scancel")
    assert_clean_run(text, "serve", "TP2 x CP2", quiet=False)
    if drain:
        check("draining the queue" in text and "cpfill serve: stopped" in text,
              "rank 0 did not drain on SIGTERM")
        r = cluster.run(["scontrol", "show", "job", job])
        check("JobState=COMPLETED" in r.stdout and "ExitCode=0:0" in r.stdout,
              f"the drained job did not complete with exit 0: {r.stdout}")


def case_bad_flag(cluster, env):
    code, text = sbatch_wait(cluster, env, f"{cluster.tmp}/bad.out", "cpfill-attention.sbatch",
                             ["--gpus-per-node=4"], ["--seq-lens", "-5"])
    check(code != 0, "a bad flag must fail the job")
    message = "cpfill: error: --seq-lens: -5 is negative"
    check(text.count(message) == 1,
          f"'{message}' appears {text.count(message)} times, not once")


def case_no_pmix(cluster, env):
    """A Slurm without the PMIx plugin: a stand-in srun on PATH lists the others."""
    fake = os.path.join(cluster.tmp, "fake-bin")
    os.mkdir(fake)
    with open(os.path.join(fake, "srun"), "w") as f:
        f.write("#!/bin/sh\n[ \"$1\" = --mpi=list ] || { echo started ranks; exit 9; }\n"
                "printf 'MPI plugin types are...\\n\\tnone\\n\\tcray_shasta\\n\\tpmi2\\n'\n")
    os.chmod(os.path.join(fake, "srun"), 0o755)
    env = dict(env, PATH=f"{fake}:{env['PATH']}", SLURM_JOB_ID="1")
    r = cluster.run(["bash", os.path.join(SCRIPTS, "cpfill-attention.sbatch"), "--seq-lens",
                     "64"], env=env)
    print(f"$ cpfill-attention.sbatch under an srun without pmix: exit {r.returncode}\n"
          f"{r.stdout}{r.stderr}", flush=True)
    check(r.returncode == 2, f"expected exit 2 without PMIx, got {r.returncode}")
    check("no PMIx MPI plugin" in r.stderr and "libpmix-dev" in r.stderr
          and "none cray_shasta pmi2" in r.stderr, "the message does not say what is missing")
    check("started ranks" not in r.stdout, "ranks were started without PMIx")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cpfill = os.path.abspath(sys.argv[1])
    keep = "--keep" in sys.argv[2:]
    if os.geteuid() != 0:
        print("SKIP: the Slurm test starts munged, slurmctld and slurmd as root; not root")
        sys.exit(77)
    missing = [p for p in PROGRAMS if program(p) is None]
    if missing:
        print(f"SKIP: {', '.join(missing)} not installed (launch/setup.sh installs slurm-wlm and "
              "munge)")
        sys.exit(77)

    def on_signal(sig, _):
        raise Failure(f"stopped by signal {sig}")
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in stop_signals:
        signal.signal(sig, on_signal)

    start = time.time()
    tmp = tempfile.mkdtemp(prefix="cpfill-slurm-")
    os.chmod(tmp, 0o755)  # munged wants its socket's folder searchable by all
    cluster = Cluster(tmp)
    # What a real user would not set: the CPU backend, 2 emulated nodes of 2 ranks, Open MPI as
    # root, and shared memory only (one host), so no rank listens on the network.
    env = dict(cluster.env, CPFILL=cpfill, CPFILL_BACKEND="cpu", CPFILL_RANKS_PER_NODE="2",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl="self,vader")
    failed = None
    try:
        cluster.write_config()
        cluster.up()
        print(f"slurm up in {time.time() - start:.1f} s ({tmp})", flush=True)
        cases = [("no_pmix", case_no_pmix), ("attention", case_attention),
                 ("prefill", case_prefill),
                 ("serve_drain", lambda c, e: case_serve(c, e, drain=True)),
                 ("serve_scancel", lambda c, e: case_serve(c, e, drain=False)),
                 ("bad_flag", case_bad_flag)]
        for name, case in cases:
            t = time.time()
            case(cluster, env)
            print(f"ok {name} ({time.time() - t:.1f} s)", flush=True)
    except (Failure, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
        failed = f"{type(e).__name__}: {e}"
    finally:
        for sig in stop_signals:  # the clean-up runs to its end
            signal.signal(sig, signal.SIG_IGN)
        left = cluster.stop()
        if left:
            failed = failed or f"processes left behind (killed): {left}"
        if failed:
            print(cluster.logs())
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if failed:
        print(f"FAIL: {failed}")
        sys.exit(1)
    print(f"PASS: the Slurm job scripts on a real Slurm ({time.time() - start:.1f} s)")


if __name__ == "__main__":
    main()
