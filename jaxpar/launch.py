"""`jaxpar launch --nproc N [--cpu-devices-per-proc K] -- train RECIPE ...`: N local processes
joined through jax.distributed, for tests and single-node runs.

Each child is `python -m jaxpar.cli train ...` with the JAXPAR_* variables that
jaxpar.distributed reads; the coordinator listens on loopback unless `--bind` says
otherwise. Process 0 writes to this terminal as it would alone; the others' lines are
prefixed with their index. When a process fails, the others stop on their own (their
watchdogs name it). SIGTERM or SIGINT to the launcher reaches every process as SIGTERM,
which a run of several processes takes as preemption: it saves a checkpoint and stops. The
children of a launcher killed outright get SIGTERM from the kernel instead (Linux).
Processes still running `--grace` seconds after either are killed. The exit status is the
first failure's (128 + signal for a killed process; a process that only stopped because
another was lost does not count as the cause), or 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from jaxpar.distributed import LOST_PEER_EXIT
from jaxpar.errors import ConfigError


LAUNCHER_PID = "JAXPAR_LAUNCHER_PID"  # set in each child: the process it lives and dies with


@contextlib.contextmanager
def reserved_port(host: str) -> Iterator[int]:
    """A free port on `host`, held bound (not listening) until the block ends. A port merely
    found free can be taken by anyone before process 0's coordinator binds it; held with
    SO_REUSEPORT, only another SO_REUSEPORT socket of this user can bind it too, and the
    coordinator's gRPC server is one. Connections reach only listening sockets, so holding
    it takes none of the coordinator's."""
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        if hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, 0))
        yield s.getsockname()[1]


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


def child_command(nproc: int, command: list[str], cpu_devices_per_proc: int) -> list[str]:
    """The command line each process runs: `jaxpar train ...` with its CPU device count."""
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be at least 1")
    if cpu_devices_per_proc < 1:
        raise ConfigError(f"--cpu-devices-per-proc={cpu_devices_per_proc} must be at least 1")
    if not command or command[0] != "train":
        raise ConfigError(f"jaxpar launch runs `train`, got {' '.join(command) or 'nothing'}; e.g. jaxpar launch --nproc 2 -- train llama")
    if any(arg == "--cpu-devices" or arg.startswith("--cpu-devices=") for arg in command):
        raise ConfigError("--cpu-devices inside a launched command; give --cpu-devices-per-proc to jaxpar launch instead")
    return [sys.executable, "-m", "jaxpar.cli", *command, "--cpu-devices", str(cpu_devices_per_proc)]


def launch(nproc: int, command: list[str], cpu_devices_per_proc: int, bind: str = "127.0.0.1", grace_s: float = 180.0) -> int:
    cmd = child_command(nproc, command, cpu_devices_per_proc)
    host = "127.0.0.1" if bind in ("0.0.0.0", "[::]") else bind  # where the children reach process 0
    with reserved_port(host) as port:
        return _run(nproc, cmd, f"{host}:{port}", f"{bind}:{port}", grace_s)


def _run(nproc: int, cmd: list[str], address: str, bind: str, grace_s: float) -> int:
    procs, relays = [], []
    for i in range(nproc):
        env = {
            **os.environ,
            "JAXPAR_COORDINATOR": address,
            "JAXPAR_COORDINATOR_BIND": bind,
            "JAXPAR_NUM_PROCESSES": str(nproc),
            "JAXPAR_PROCESS_ID": str(i),
            LAUNCHER_PID: str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
        }
        piped = subprocess.PIPE if i else None  # process 0 owns the terminal (progress bar)
        # Own sessions: a Ctrl-C reaches the children once, from this launcher, as preemption.
        proc = subprocess.Popen(cmd, env=env, stdout=piped, stderr=subprocess.STDOUT if i else None, text=True,
                                start_new_session=True)
        if i:
            relays.append(threading.Thread(target=_relay, args=(proc.stdout, f"[process {i}] "), daemon=True))
            relays[-1].start()
        procs.append(proc)
        print(f"jaxpar launch: process {i} of {nproc} is pid {proc.pid} (coordinator {address})", file=sys.stderr, flush=True)

    asked = []  # when this launcher was told to stop (SIGTERM, SIGINT)

    def forward(signum, frame):
        asked.append(time.monotonic())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # JAX's preemption service takes SIGTERM, not SIGINT

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(procs, grace_s, asked)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for relay in relays:  # the last lines of the other processes, their errors included
            relay.join(timeout=5)


def _supervise(procs: list[subprocess.Popen], grace_s: float, asked: list[float]) -> int:
    """Wait for every process. After one fails, or after the launcher is told to stop, the
    rest get `grace_s` to end on their own (a preempted run saves a checkpoint first)."""
    failures: list[int] = []  # exit statuses, in the order the processes failed
    failed_at = None
    reported: set[int] = set()

    def note(i: int, code: int) -> None:
        reported.add(i)
        if code != 0:
            print(f"jaxpar launch: process {i} {_describe(code)}", file=sys.stderr, flush=True)
            failures.append(_status(code))

    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            if p.poll() is not None and i not in reported:
                note(i, p.returncode)
                if failures and failed_at is None:
                    failed_at = time.monotonic()
        since = min([t for t in (failed_at, *asked) if t is not None], default=None)
        if since is not None and time.monotonic() - since > grace_s:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    print(f"jaxpar launch: process {i} still runs {grace_s:g} s on; killing it", file=sys.stderr, flush=True)
                    p.kill()  # JAX's preemption service holds SIGTERM: only SIGKILL is sure
            for p in procs:
                p.wait()
        time.sleep(0.1)
    for i, p in enumerate(procs):
        if i not in reported:
            note(i, p.returncode)
    # The cause, not its echo: a process that stopped because another was lost says so.
    causes = [code for code in failures if code != LOST_PEER_EXIT]
    return (causes or failures or [0])[0]


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _relay(stream, prefix: str) -> None:
    for line in stream:
        sys.stderr.write(prefix + line)
        sys.stderr.flush()
