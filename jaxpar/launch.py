"""`jaxpar launch --nproc N [--cpu-devices-per-proc K] -- train RECIPE ...`: N local processes
joined through jax.distributed, for tests and single-node runs.

Each child is `python -m jaxpar.commands train ...` with the JAXPAR_* variables that
jaxpar.distributed reads; the coordinator listens on loopback unless `--bind` says
otherwise. Every child's output comes through this launcher (Relay): process 0's as it
would write alone, the others' lines prefixed with their index. Unless `--verbose`, the
libraries' chatter is left out (XLA's and gRPC's C++ logging below fatal, Gloo's
connection lines, the coordination service's complaints when another process died), and
a `jaxpar: ...` line that several processes print alike (the same config error) is shown
once. When a process fails, the others stop on their own (their watchdogs name it); the
launcher names the cause (first_cause: of the failures seen within moments of each other, a
process killed by a signal before one that aborted because its peer vanished) and sums up
the rest in one line. SIGTERM or SIGINT to
the launcher reaches every process as SIGTERM, which a run of several processes takes as
preemption: it saves a checkpoint and stops. The children of a launcher killed outright
get SIGTERM from the kernel instead (Linux). Processes still running `--grace` seconds
after either are killed. The exit status is the cause's (128 + signal for a killed
process; a process that only stopped because another was lost does not count as the
cause), or 0.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time

from jaxpar.distributed import LOST_PEER_EXIT, reserved_port
from jaxpar.errors import ConfigError
from jaxpar.logs import ABSL


LAUNCHER_PID = "JAXPAR_LAUNCHER_PID"  # set in each child: the process it lives and dies with
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}  # XLA's and gRPC's C++ (absl) logging: fatal errors only
POLL_S = 0.1  # how often the launcher looks at its processes
SETTLE_S = 0.5  # after a first failure, how long the launcher waits for others before naming the cause

# Library chatter, left out of the children's output unless --verbose:
# Gloo's "[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7",
# written to std::cout piece by piece with no switch to turn it off: threads interleave the
# pieces, so a line made of nothing but such pieces is one.
GLOO = re.compile(r"(\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :|\d+|\s+)+")
# The coordination service's messages once another process is gone: that process says why.
TEARDOWN = re.compile(r"Terminating process because the JAX distributed service|preemption_sync_manager\.cc:|"
                      r"coordination_service_agent\.cc:")
CONTINUED = re.compile(r"^(Additional GRPC error information|:[A-Z_]+:|=== Source Location Trace: ===|\S+\.(cc|h):\d+$|"
                       r"\. This is only expected|$)")  # the rest of such a message
FRAMES = re.compile(r"^(\*\*\* Check failure stack trace: \*\*\*$|\s+@\s+0x)")  # a C++ fatal error's stack
# A C++ log message's start after other text on one line: C++ writes straight to the file
# descriptor, between a Python line and its newline when their timing is unlucky.
MID_LINE_LOG = re.compile(r"[^\s][IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\] ")
# A watchdog's word that another process failed or went: the launcher names that process itself.
ECHO = re.compile(r"^jaxpar: process \d+: (process \d+ of \d+ stopped on an error|lost the coordinator)")


def follow_launcher(env=os.environ) -> None:
    """In a process that `jaxpar launch` started: have the kernel send it SIGTERM when the
    launcher dies (Linux), so a launcher killed outright leaves nothing training. SIGTERM is
    preemption to a run of several processes: each saves and stops."""
    launcher = env.get(LAUNCHER_PID)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


LAUNCHED = ("train", "export", "sample")  # the commands that run as one process of several


def child_command(nproc: int, command: list[str], cpu_devices_per_proc: int) -> list[str]:
    """The command line each process runs: `jaxpar train ...` (or export, or sample) with its CPU device count."""
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be at least 1")
    if cpu_devices_per_proc < 1:
        raise ConfigError(f"--cpu-devices-per-proc={cpu_devices_per_proc} must be at least 1")
    if not command or command[0] not in LAUNCHED:
        raise ConfigError(f"jaxpar launch runs {', '.join(LAUNCHED)}, got {' '.join(command) or 'nothing'}; "
                          "e.g. jaxpar launch --nproc 2 -- train llama")
    if any(arg == "--cpu-devices" or arg.startswith("--cpu-devices=") for arg in command):
        raise ConfigError("--cpu-devices inside a launched command; give --cpu-devices-per-proc to jaxpar launch instead")
    return [sys.executable, "-m", "jaxpar.commands", *command, "--cpu-devices", str(cpu_devices_per_proc)]


def launch(nproc: int, command: list[str], cpu_devices_per_proc: int, bind: str = "127.0.0.1", grace_s: float = 180.0,
           verbose: bool = False) -> int:
    cmd = child_command(nproc, command, cpu_devices_per_proc)
    host = "127.0.0.1" if bind in ("0.0.0.0", "[::]") else bind  # where the children reach process 0
    with reserved_port(host) as port:
        return _run(nproc, cmd, f"{host}:{port}", f"{bind}:{port}", grace_s, verbose)


def child_env(i: int, nproc: int, address: str, bind: str, verbose: bool) -> dict[str, str]:
    env = {
        **os.environ,
        "JAXPAR_COORDINATOR": address,
        "JAXPAR_COORDINATOR_BIND": bind,
        "JAXPAR_NUM_PROCESSES": str(nproc),
        "JAXPAR_PROCESS_ID": str(i),
        LAUNCHER_PID: str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
    }
    if not verbose:
        env.update({k: v for k, v in QUIET_ENV.items() if k not in os.environ})  # a level the user set wins
    return env


def _run(nproc: int, cmd: list[str], address: str, bind: str, grace_s: float, verbose: bool) -> int:
    relay, procs = Relay(verbose), []
    for i in range(nproc):
        # Own sessions: a Ctrl-C reaches the children once, from this launcher, as preemption.
        # Process 0 keeps its two streams (its progress bar on stderr); the others' are merged.
        proc = subprocess.Popen(cmd, env=child_env(i, nproc, address, bind, verbose), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE if i == 0 else subprocess.STDOUT, start_new_session=True)
        if i == 0:
            relay.start(0, proc.stdout, sys.stdout, "")
            relay.start(0, proc.stderr, sys.stderr, "")
        else:
            relay.start(i, proc.stdout, sys.stderr, f"[process {i}] ")
        procs.append(proc)
    relay.say(f"jaxpar launch: {nproc} processes, pids {' '.join(str(p.pid) for p in procs)} (coordinator {address})")

    asked = []  # when this launcher was told to stop (SIGTERM, SIGINT)

    def forward(signum, frame):
        asked.append(time.monotonic())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # JAX's preemption service takes SIGTERM, not SIGINT

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(procs, grace_s, asked, relay)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relay.finish()  # the last lines of the processes, their errors included


def _supervise(procs: list[subprocess.Popen], grace_s: float, asked: list[float], relay: Relay) -> int:
    """Wait for every process. After one fails, or after the launcher is told to stop, the
    rest get `grace_s` to end on their own (a preempted run saves a checkpoint first). The
    cause (first_cause) is named SETTLE_S after the first failure is seen, the later
    failures in one line at the end; the exit status is the cause's."""
    exits: list[Exit] = []  # in the order they were seen
    named: Exit | None = None

    def name_cause() -> Exit:
        cause = first_cause(exits)
        relay.finish(cause.process)  # its own last words before the launcher's
        relay.say(f"jaxpar launch: process {cause.process} {_describe(cause.code)}")
        return cause

    while True:
        now, running = time.monotonic(), [p.poll() is None for p in procs]
        seen = {e.process for e in exits}
        exits += [Exit(i, p.returncode, now) for i, p in enumerate(procs) if not running[i] and i not in seen]
        failed_at = min((e.seen for e in exits if e.code != 0), default=None)
        if named is None and failed_at is not None and (now - failed_at >= SETTLE_S or not any(running)):
            named = name_cause()
        if not any(running):
            break
        since = min([t for t in (failed_at, *asked) if t is not None], default=None)
        if since is not None and now - since > grace_s:
            named = named or (name_cause() if failed_at is not None else None)  # before the kills below
            _kill_stuck(procs, grace_s, relay)
        time.sleep(POLL_S)
    later = [e for e in exits if e.code != 0 and e != named]
    if later:
        relay.finish()
        relay.say("jaxpar launch: then " + ", ".join(f"process {e.process} {_describe(e.code)}" for e in later))
    cause = first_cause(exits)  # over every exit: a lost peer's echo named first gives way to what it echoed
    return 0 if cause is None else _status(cause.code)


def _kill_stuck(procs: list[subprocess.Popen], grace_s: float, relay: Relay) -> None:
    stuck = [i for i, p in enumerate(procs) if p.poll() is None]
    if stuck:
        many = len(stuck) > 1
        relay.say(f"jaxpar launch: process{'es' if many else ''} {', '.join(map(str, stuck))} still "
                  f"run{'' if many else 's'} {grace_s:g} s on; killing {'them' if many else 'it'}")
    for i in stuck:
        procs[i].kill()  # JAX's preemption service holds SIGTERM: only SIGKILL is sure
    for p in procs:
        p.wait()


@dataclasses.dataclass(frozen=True)
class Exit:
    """A process the launcher saw gone: its index, its return code as Popen gives it
    (negative: killed by that signal), and when it was seen (time.monotonic())."""

    process: int
    code: int
    seen: float


def first_cause(exits: list[Exit], settle_s: float = SETTLE_S) -> Exit | None:
    """The failure to name as the cause, None if none failed. A process's death brings
    others down within moments (gloo aborts a collective whose peer vanished), often within
    one poll, so the order seen does not say which came first. Of the failures seen within
    `settle_s` of the first, the likeliest cause wins: a signal from outside (SIGKILL,
    SIGTERM, ...), then an exit status of its own, then an abort (SIGABRT, 134), which a
    lost peer provokes; then the earliest seen, then the lowest index. A process that exited
    because another was lost (LOST_PEER_EXIT) is the cause only when nothing else failed."""
    failed = [e for e in exits if e.code != 0]
    causes = [e for e in failed if _status(e.code) != LOST_PEER_EXIT] or failed
    if not causes:
        return None
    first = min(e.seen for e in causes)
    settled = [e for e in causes if e.seen - first <= settle_s]
    return min(settled, key=lambda e: (_consequence(e.code), e.seen, e.process))


def _consequence(code: int) -> int:
    """How likely an exit is the echo of another's rather than a cause: 0 killed by a
    signal other than SIGABRT, 1 an exit status, 2 an abort."""
    if code == -signal.SIGABRT or code == 128 + signal.SIGABRT:
        return 2
    return 0 if code < 0 else 1


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class Relay:
    """Copies the processes' output to this launcher's stdout and stderr, a line at a time,
    leaving out the libraries' chatter and repeats of a `jaxpar: ` line another process
    printed (unless verbose). A line still being drawn (a progress bar's carriage returns)
    is copied as it comes."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.lock = threading.Lock()  # one writer at a time: lines stay whole
        self.said: dict[str, int] = {}  # a `jaxpar: ` line -> the process that printed it first
        self.threads: dict[int, list[threading.Thread]] = {}
        self.open: dict = {}  # output -> the stream whose unfinished line it shows last

    def start(self, process: int, stream, out, prefix: str) -> None:
        thread = threading.Thread(target=self._copy, args=(process, stream, out, prefix), daemon=True)
        self.threads.setdefault(process, []).append(thread)
        thread.start()

    def finish(self, process: int | None = None, timeout_s: float = 5.0) -> None:
        """Wait (a while: a grandchild may hold a pipe open) for the copies to reach the end."""
        for i, threads in self.threads.items():
            for thread in threads if process in (None, i) else []:
                thread.join(timeout_s)

    def say(self, line: str) -> None:
        """A line of the launcher's own, on stderr, on a line of its own."""
        self._write(sys.stderr, line + "\n", None, ended=True)

    def _write(self, out, text: str, source, ended: bool) -> None:
        with self.lock:
            if self.open.get(out, source) != source:
                text = "\n" + text  # not after another stream's unfinished line (a progress bar)
            try:
                out.write(text)
                out.flush()
            except (OSError, ValueError):  # our own output closed (`| head`): drain on, or a child blocks on its pipe
                pass
            if ended:
                self.open.pop(out, None)
            else:
                self.open[out] = source

    def _copy(self, process: int, stream, out, prefix: str) -> None:
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        dropping = [False, False]  # inside a chatter message's continuation lines; the last line was Gloo's
        pending, started = "", False  # the unfinished line; whether its start is out already
        while chunk := stream.read1(65536):
            *lines, pending = (pending + decode(chunk)).split("\n")
            for line in lines:
                self._line(process, line, stream, out, "" if started else prefix, dropping)
                started = False
            if pending and ("\r" in pending or started):  # a progress bar drawn in place: show it now
                self._write(out, ("" if started else prefix) + pending, stream, ended=False)
                pending, started = "", True
        if pending:
            self._line(process, pending, stream, out, "" if started else prefix, dropping)
        stream.close()

    def _line(self, process: int, line: str, stream, out, prefix: str, dropping: list[bool]) -> None:
        inside = MID_LINE_LOG.search(line)
        if inside and not self.verbose:  # a C++ log written between a Python line and its newline: two lines
            self._line(process, line[:inside.start() + 1], stream, out, prefix, dropping)
            return self._line(process, line[inside.start() + 1:], stream, out, prefix, dropping)
        if self.verbose or not (self._chatter(line, dropping) or self._repeated(process, line)):
            self._write(out, prefix + line + "\n", stream, ended=True)

    @staticmethod
    def _chatter(line: str, dropping: list[bool]) -> bool:
        if ABSL.match(line):
            dropping[0] = bool(TEARDOWN.search(line))
            return dropping[0]
        if dropping[0] and CONTINUED.match(line):
            return True
        dropping[0] = False
        # a Gloo line, or what a thread wrote of one after another thread's newline ended it (a count, nothing)
        gloo = (("[Gloo]" in line or "peer ranks" in line) and GLOO.fullmatch(line)) or (
            dropping[1] and re.fullmatch(r"\s*\d*\s*", line))
        dropping[1] = bool(gloo)
        return bool(gloo or FRAMES.match(line))

    def _repeated(self, process: int, line: str) -> bool:
        if not line.startswith("jaxpar: "):
            return False
        if ECHO.match(line):
            return True
        with self.lock:
            return self.said.setdefault(line, process) != process
