"""Several processes, one mesh: where the cluster is (read from the environment), joining
it through `jax.distributed`, and a watchdog that turns a lost process into a prompt exit
that names it.

The environment says where the processes are, so the same `jaxpar train` runs alone, under
`jaxpar launch`, or under SLURM:

- `JAXPAR_COORDINATOR` (host:port of process 0), `JAXPAR_NUM_PROCESSES`, `JAXPAR_PROCESS_ID`,
  and optionally `JAXPAR_COORDINATOR_BIND` (where process 0 listens; default all
  interfaces, as JAX does) and `JAXPAR_LOCAL_DEVICE_IDS` (e.g. "0,1"): set by `jaxpar launch`,
  or by hand on any cluster;
- otherwise SLURM (`srun`): process count and index from SLURM_NTASKS and SLURM_PROCID, the
  coordinator on the step's first node, at `JAXPAR_COORDINATOR_PORT` or a port derived from
  the job and step ids. Each process drives the devices it sees, so bind GPUs with SLURM
  (`--ntasks-per-node=1`, or `--gpus-per-task=1`).

On CPUs the collectives of several processes run over gloo, whose all-reduce sums in a ring
and whose reduce-scatter halves and doubles, while one process alone sums in XLA's
in-process collectives, in rank order. Any reduction over two devices is the same either way
(a + b = b + a), but one over more may differ in the last bits. `JAXPAR_CPU_COLLECTIVES=gloo`
makes a process running alone use gloo too, joined to a cluster of one on loopback: it then
computes every layout bitwise as a run of several processes with the same devices does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping

from jaxpar.errors import ConfigError

EXPLICIT = ("JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID")
CPU_COLLECTIVES = "JAXPAR_CPU_COLLECTIVES"  # "gloo": one process alone runs gloo's collectives too
ALONE = "127.0.0.1:0"  # the coordinator of a cluster of one: loopback, a free port chosen on joining
SLURM = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")
LOST_PEER_EXIT = 3  # the exit status of a process that stops because another was lost


@dataclasses.dataclass(frozen=True)
class Cluster:
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    bind: str | None = None  # where process 0 listens; None: all interfaces on the port
    local_device_ids: tuple[int, ...] | None = None  # None: every device this process sees
    source: str = "JAXPAR_*"


def from_environment(env: Mapping[str, str] = os.environ) -> Cluster | None:
    """The cluster this process belongs to, or None when it runs alone (with
    JAXPAR_CPU_COLLECTIVES=gloo: a cluster of one, so that it runs gloo's collectives)."""
    gloo = _gloo_alone(env)
    given = [k for k in EXPLICIT if env.get(k)]
    if given:
        missing = [k for k in EXPLICIT if k not in given]
        if missing:
            raise ConfigError(
                f"{', '.join(given)} set but {', '.join(missing)} not; set all of {', '.join(EXPLICIT)} "
                "(or none, to run alone)"
            )
        cluster = _checked(
            Cluster(
                coordinator=_address(env["JAXPAR_COORDINATOR"], "JAXPAR_COORDINATOR"),
                num_processes=_int(env, "JAXPAR_NUM_PROCESSES"),
                process_id=_int(env, "JAXPAR_PROCESS_ID"),
                bind=_bind(env),
                local_device_ids=_device_ids(env.get("JAXPAR_LOCAL_DEVICE_IDS", "")),
            )
        )
        return cluster if cluster.num_processes > 1 or gloo else None  # one process: alone
    if all(env.get(k) for k in SLURM) and _int(env, "SLURM_NTASKS") > 1:
        nodes = env.get("SLURM_STEP_NODELIST")
        if not nodes:  # a batch script or salloc shell: only srun starts the tasks that join
            raise ConfigError(
                f"SLURM_NTASKS={env['SLURM_NTASKS']} but this is not a task of an srun step (no SLURM_STEP_NODELIST); "
                "start jaxpar train with srun, or unset SLURM_NTASKS to run alone"
            )
        port = (_int(env, "JAXPAR_COORDINATOR_PORT") if env.get("JAXPAR_COORDINATOR_PORT")
                else slurm_port(env["SLURM_JOB_ID"], env.get("SLURM_STEP_ID", "0")))
        return _checked(
            Cluster(
                coordinator=f"{first_host(nodes)}:{port}",
                num_processes=_int(env, "SLURM_NTASKS"),
                process_id=_int(env, "SLURM_PROCID"),
                bind=_bind(env),
                source="SLURM",
            )
        )
    return Cluster(ALONE, 1, 0, bind=ALONE, source=CPU_COLLECTIVES) if gloo else None


def _gloo_alone(env: Mapping[str, str]) -> bool:
    value = env.get(CPU_COLLECTIVES, "")
    if value not in ("", "gloo"):
        raise ConfigError(
            f"{CPU_COLLECTIVES}={value!r} is not a CPU collectives implementation jaxpar runs; use gloo "
            "(one process computes as several do, bitwise) or leave it unset (XLA's in-process collectives)"
        )
    return value == "gloo"


def slurm_port(job_id: str, step_id: str = "0") -> int:
    """A port every task of the step derives alike, in 20000-29999 (below the usual
    ephemeral range, so a client socket rarely holds it); steps running at once differ."""
    number = lambda text: int(re.sub(r"\D", "", text) or 0)  # noqa: E731
    return 20000 + (number(job_id) * 7 + number(step_id)) % 10000


def first_host(nodelist: str) -> str:
    """The first host of SLURM's compressed list: 'gpu[07-08,11],cpu1' -> gpu07;
    'a[1-2]b[3-4]' -> a1b3."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # commas outside brackets separate hosts
    host = re.sub(r"\[([^\]]+)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)
    if not host:
        raise ConfigError(f"SLURM_STEP_NODELIST={nodelist!r} names no host")
    return host


def _checked(cluster: Cluster) -> Cluster:
    if cluster.num_processes < 1 or not 0 <= cluster.process_id < cluster.num_processes:
        raise ConfigError(
            f"process id {cluster.process_id} of {cluster.num_processes} processes ({cluster.source}); "
            "the id must be in 0 .. count - 1"
        )
    return cluster


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"{key}={env[key]!r} is not an integer") from None


def _address(text: str, key: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{key}={text!r} is not host:port; e.g. {key}=10.0.0.1:12345")
    return text


def _bind(env: Mapping[str, str]) -> str | None:
    text = env.get("JAXPAR_COORDINATOR_BIND")
    return _address(text, "JAXPAR_COORDINATOR_BIND") if text else None


def _device_ids(text: str) -> tuple[int, ...] | None:
    if not text.strip():
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"JAXPAR_LOCAL_DEVICE_IDS={text!r} is not a comma-separated list of device ids; e.g. 0,1") from None


def join(cluster: Cluster, heartbeat_timeout_s: int, join_timeout_s: int) -> None:
    """Connect this process to the others (before JAX starts its backends). Collectives
    across processes run over NCCL on GPUs and gloo on CPUs. JAX's own heartbeat is the
    backstop, at three times the watchdog's timeout, for a process too stuck to run its
    watchdog: at twice it, JAX's coordinator (which counts from a frozen process's last beat,
    sent up to a beat's period before it froze) could end process 0 with SIGABRT before the
    watchdog named the frozen one (seen once, on a loaded machine: 8.2 s after a freeze with
    a 5 s timeout).
    A cluster of one (JAXPAR_CPU_COLLECTIVES=gloo) listens on a free loopback port and keeps
    SIGTERM as a process alone has it: JAX's preemption service would take it, and there is
    no other process to agree on a step with."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cluster.num_processes == 1:
        jax.config.update("jax_enable_preemption_service", False)
    if cluster.coordinator == ALONE:

        with reserved_port("127.0.0.1") as port:  # held until the coordinator binds it too
            address = f"127.0.0.1:{port}"
            return join(dataclasses.replace(cluster, coordinator=address, bind=address), heartbeat_timeout_s,
                        join_timeout_s)
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator,
        num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        local_device_ids=list(cluster.local_device_ids) if cluster.local_device_ids else None,
        coordinator_bind_address=cluster.bind,
        initialization_timeout=join_timeout_s,
        heartbeat_timeout_seconds=3 * heartbeat_timeout_s,
        # JAX's own SLURM detection would give each process only device SLURM_LOCALID.
        cluster_detection_method="deactivate",
    )


class Watchdog:
    """Each process posts a heartbeat to the coordinator's key-value store every second and
    reads the others'. A process whose beat has not changed for `timeout_s` is lost (killed,
    or its Python stuck; one merely waiting in a collective still beats, as its watchdog is a
    thread); one that posts `failed` stopped on an error. Either way this process prints a message naming it
    and exits with LOST_PEER_EXIT, rather than wait in a collective that will never finish.
    If process 0 dies, the coordinator goes with it and JAX ends the others at once."""

    def __init__(self, timeout_s: float, interval_s: float = 1.0, client=None, process_id: int = 0, num_processes: int = 1):
        if client is None:  # this process's link to the coordinator's key-value store
            from jax._src.distributed import global_state  # JAX keeps it there; there is no public handle

            client, process_id, num_processes = global_state.client, global_state.process_id, global_state.num_processes
        self.client, self.me, self.count = client, process_id, num_processes
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self._changed: dict[int, tuple[str, float]] = {}  # process -> (last beat, when it changed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxpar-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self, error: str | None = None) -> None:
        """Stop watching and tell the others this process ended: cleanly, or on `error`."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 10)  # a key-value call stuck on a dead coordinator
        try:
            self._post("failed: " + error if error else "done")
        except Exception:  # the coordinator may be gone already; nothing is left to tell
            pass

    def _post(self, value: str) -> None:
        self.client.key_value_set(f"jaxpar/heartbeat/{self.me}", value, allow_overwrite=True)

    def _watch(self) -> None:
        beat = 0
        while not self._stop.wait(0 if beat == 0 else self.interval_s):
            beat += 1
            try:
                self._post(f"beat {beat}")
                posted = dict(self.client.key_value_dir_get("jaxpar/heartbeat/"))
            except Exception as e:
                return self._exit(f"lost the coordinator (process 0): {str(e).splitlines()[0]}")
            why = self.verdict(posted, time.monotonic())
            if why is not None:
                if "stopped on an error" in why:
                    time.sleep(min(5.0, self.timeout_s))  # let this process end on its own error first
                return self._exit(why)

    def verdict(self, posted: Mapping[str, str], now: float) -> str | None:
        """Why this process must stop, given the heartbeats `posted` at time `now` (seconds,
        any clock), or None while every other process is beating, done, or not yet seen
        long enough. Remembers when each process's beat last changed."""
        for p in range(self.count):
            value = posted.get(f"jaxpar/heartbeat/{p}", "")
            if p == self.me or value == "done":
                continue
            if value.startswith("failed: "):
                return f"process {p} of {self.count} stopped on an error: {value[8:]}"
            if p not in self._changed or self._changed[p][0] != value:
                self._changed[p] = (value, now)
            elif now - self._changed[p][1] > self.timeout_s:
                return (f"process {p} of {self.count} sent no heartbeat for {self.timeout_s:g} s "
                        "(distributed.heartbeat_timeout_s): it died or stopped responding")
        return None

    def _exit(self, why: str) -> None:
        if self._stop.is_set():
            return
        print(f"jaxpar: process {self.me}: {why}; stopping this process too", file=sys.stderr, flush=True)
        self.exit(LOST_PEER_EXIT)

    exit = staticmethod(os._exit)  # the main thread may be blocked in a collective that never ends


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
