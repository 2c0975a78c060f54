"""Several processes (jaxpar.distributed, jaxpar.launch): finding the cluster in the
environment, the watchdog, and real runs of 2 processes x 4 CPU devices over gloo."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxpar.distributed import LOST_PEER_EXIT, Cluster, Watchdog, first_host, from_environment, slurm_port
from jaxpar.errors import ConfigError
from jaxpar.launch import child_command

# ------------------------------------------------------------------ the environment


def test_explicit_variables_name_the_cluster():
    env = {"JAXPAR_COORDINATOR": "10.0.0.1:1234", "JAXPAR_NUM_PROCESSES": "4", "JAXPAR_PROCESS_ID": "2",
           "JAXPAR_LOCAL_DEVICE_IDS": "0,1"}
    assert from_environment(env) == Cluster("10.0.0.1:1234", 4, 2, None, (0, 1), "JAXPAR_*")
    assert from_environment({}) is None  # alone
    assert from_environment({**env, "JAXPAR_NUM_PROCESSES": "1", "JAXPAR_PROCESS_ID": "0"}) is None  # one: alone


def test_cpu_collectives_gloo_makes_a_process_alone_a_cluster_of_one():
    """JAXPAR_CPU_COLLECTIVES=gloo: one process joins a cluster of one (loopback, its port
    chosen on joining), so its collectives are gloo's, as with several processes; an explicit
    count of one keeps the coordinator given; any other value is refused by name."""
    gloo = {"JAXPAR_CPU_COLLECTIVES": "gloo"}
    assert from_environment(gloo) == Cluster("127.0.0.1:0", 1, 0, "127.0.0.1:0", None, "JAXPAR_CPU_COLLECTIVES")
    one = {"JAXPAR_COORDINATOR": "10.0.0.1:1234", "JAXPAR_NUM_PROCESSES": "1", "JAXPAR_PROCESS_ID": "0"}
    assert from_environment({**one, **gloo}) == Cluster("10.0.0.1:1234", 1, 0)
    assert from_environment({**one, "JAXPAR_NUM_PROCESSES": "2", **gloo}).num_processes == 2  # several: gloo anyway
    assert from_environment({"JAXPAR_CPU_COLLECTIVES": ""}) is None
    with pytest.raises(ConfigError, match="JAXPAR_CPU_COLLECTIVES='mpi' is not .* use gloo"):
        from_environment({"JAXPAR_CPU_COLLECTIVES": "mpi"})


@pytest.mark.parametrize("env, message", [
    ({"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "2"}, "JAXPAR_PROCESS_ID not"),
    ({"JAXPAR_COORDINATOR": "h", "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "0"}, "JAXPAR_COORDINATOR='h' is not host:port"),
    ({"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "2"}, "process id 2 of 2"),
    ({"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "two", "JAXPAR_PROCESS_ID": "0"}, "JAXPAR_NUM_PROCESSES='two'"),
    ({"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "0",
      "JAXPAR_LOCAL_DEVICE_IDS": "0;1"}, "JAXPAR_LOCAL_DEVICE_IDS='0;1'"),
])
def test_bad_variables_are_refused_by_name(env, message):
    with pytest.raises(ConfigError, match=message):
        from_environment(env)


def test_slurm_tasks_find_the_first_node_and_a_shared_port():
    env = {"SLURM_JOB_ID": "4711", "SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_STEP_ID": "0",
           "SLURM_STEP_NODELIST": "gpu[07-08],cpu1", "SLURM_JOB_NODELIST": "gpu[07-08],cpu1"}
    cluster = from_environment(env)
    assert cluster == Cluster(f"gpu07:{slurm_port('4711', '0')}", 16, 9, None, None, "SLURM")
    assert 20000 <= slurm_port("4711") < 30000 and slurm_port("4711", "1") != slurm_port("4711", "0")
    assert from_environment({**env, "JAXPAR_COORDINATOR_PORT": "5555"}).coordinator == "gpu07:5555"
    assert from_environment({**env, "SLURM_NTASKS": "1"}) is None  # one task: alone
    batch_script = {k: v for k, v in env.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(ConfigError, match="not a task of an srun step"):  # would wait for 15 others forever
        from_environment(batch_script)


def test_slurm_host_lists_give_the_first_host():
    assert first_host("node1") == "node1"
    assert first_host("gpu[01-03,07],login1") == "gpu01"
    assert first_host("a[9-10]-ib,b1") == "a9-ib"
    assert first_host("a[1-2]b[3-4]") == "a1b3"
    assert first_host("login1,gpu[01-02]") == "login1"


def test_launch_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="runs train, export, sample, got explain llama"):
        child_command(2, ["explain", "llama"], 4)
    with pytest.raises(ConfigError, match="--cpu-devices-per-proc"):
        child_command(2, ["train", "llama", "--cpu-devices", "4"], 4)
    with pytest.raises(ConfigError, match="--nproc=0"):
        child_command(0, ["train", "llama"], 4)
    assert child_command(2, ["train", "llama"], 3)[-2:] == ["--cpu-devices", "3"]


def test_a_reserved_port_is_refused_to_others_and_open_to_the_coordinator():
    """Between choosing the coordinator's port and process 0 binding it, nothing else may
    take it: a plain socket cannot bind it; one with SO_REUSEPORT (gRPC's default, as the
    coordinator's server) can, and listen."""
    import socket

    from jaxpar.distributed import reserved_port

    with reserved_port("127.0.0.1") as port:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with socket.socket() as coordinator:
            coordinator.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            coordinator.bind(("127.0.0.1", port))
            coordinator.listen()


TEARDOWN = """\
W1124 11:37:42.036676   11319 preemption_sync_manager.cc:147] Failed to retrieve preemption notice: UNAVAILABLE
Additional GRPC error information from remote target coordination_service while calling /xla.Coordination/GetKeyValue:
:UNAVAILABLE:Stream removed (Socket closed)
=== Source Location Trace: ===
external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89
. This is only expected if one of the tasks is unhealthy. Check the logs for the actual root cause.
F1124 11:37:42.036732   11319 client.h:86] Terminating process because the JAX distributed service detected fatal errors.
:UNAVAILABLE:Stream removed (Socket closed)

*** Check failure stack trace: ***
    @     0x7f95c5ef81b4  absl::lts_20260526::log_internal::LogMessage::SendToLog()
    @     0x7f95cdca71f5  (unknown)"""


class Chunks:
    """A pipe's reads: `parts` one at a time, as a child wrote them."""

    def __init__(self, *parts: bytes):
        self.parts, self.out, self.seen = list(parts), None, []  # seen: what `out` showed at each read

    def read1(self, size):
        if self.out is not None:
            self.seen.append(self.out.getvalue())
        return self.parts.pop(0) if self.parts else b""

    def close(self):
        pass


def _relayed(outputs: dict, verbose=False):
    """What jaxpar.launch.Relay makes of each process's output (text, or Chunks of bytes, by
    process): the launcher's stdout and stderr."""
    import io

    from jaxpar import launch

    out, err = io.StringIO(), io.StringIO()
    relay = launch.Relay(verbose)
    real = sys.stderr
    sys.stderr = err  # Relay.say writes to sys.stderr
    try:
        for i, text in outputs.items():
            stream = text if isinstance(text, Chunks) else Chunks(text.encode())
            stream.out = out if i == 0 else err
            relay.start(i, stream, stream.out, "" if i == 0 else f"[process {i}] ")
            relay.finish(i)
        relay.say("jaxpar launch: process 0 exited with status 2")
    finally:
        sys.stderr = real
    return out.getvalue(), err.getvalue()


def test_the_relay_leaves_out_library_chatter_and_repeats_but_never_a_process_s_own_error():
    error = "jaxpar: error: mesh.data=-1 cannot fill 6 devices; use axis sizes whose product divides 6"
    gloo = ("[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
            "1 is connected to 1 peer ranks. Expected number of connected peer ranks is : \n3\n\n")  # threads' pieces
    own = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nOSError: no tokens.npy\n"
           "F1124 11:00:00.000000 1 spmd_partitioner.cc:9] Check failed: shard_count > 0\n"
           "*** Check failure stack trace: ***\n    @     0x7f95c5ef81b4  xla::Partition()\n")
    echo = "jaxpar: process 1: process 0 of 3 stopped on an error: ConfigError: x; stopping this process too\n"

    def outputs():
        bar = "\r 50%|█ | 1/2".encode()  # cut inside a character, and drawn before its line ends
        zero = Chunks(gloo.encode() + b"loss 6.08 ", b"-> 6.11\n" + bar[:8], bar[8:], "\r100%|██| 2/2\n".encode(),
                      error.encode() + b"\n")
        # process 3's error line met a C++ log in mid-line (C++ wrote between the text and its newline)
        return {0: zero, 1: own + echo, 2: error + "\n" + TEARDOWN, 3: error + TEARDOWN}

    zero = (given := outputs())[0]
    out, err = _relayed(given)
    assert out == "loss 6.08 -> 6.11\n\r 50%|█ | 1/2\r100%|██| 2/2\n" + error + "\n"
    assert zero.seen[3] == "loss 6.08 -> 6.11\n\r 50%|█ | 1/2"  # the bar as drawn, its line not yet ended
    assert err.splitlines() == [
        "[process 1] Traceback (most recent call last):", '[process 1]   File "x.py", line 1, in <module>',
        "[process 1] OSError: no tokens.npy",
        "[process 1] F1124 11:00:00.000000 1 spmd_partitioner.cc:9] Check failed: shard_count > 0",
        "jaxpar launch: process 0 exited with status 2"]
    out, err = _relayed(outputs(), verbose=True)  # jaxpar launch --verbose: everything
    assert out.count("[Gloo]") == 2 and err.count(error) == 2 and "stopping this process too" in err
    assert TEARDOWN.splitlines()[-1] in err and "Terminating process" in err
    alone = _relayed({3: error + TEARDOWN})[1]  # its error kept (the first to say it), the log left out
    assert alone.splitlines() == [f"[process 3] {error}", "jaxpar launch: process 0 exited with status 2"]


# ------------------------------------------------------------------ the watchdog


class Store:
    """The coordinator's key-value store, in memory; `down` makes every call fail."""

    def __init__(self):
        self.values, self.down, self.lock = {}, False, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        with self.lock:
            self.values[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        with self.lock:
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def _dog(store=None, timeout=0.3):
    """Process 0 of 2 watching `store`; its exits are recorded, not taken."""
    dog = Watchdog(timeout, interval_s=0.02, client=store or Store(), process_id=0, num_processes=2)
    dog.exits = []
    dog.exited = threading.Event()
    dog.exit = lambda status: (dog.exits.append(status), dog.exited.set())
    return dog


def test_verdict_names_a_process_that_stopped_beating():
    """The decision alone, on a made-up clock: a beat unchanged for longer than the timeout."""
    dog = _dog(timeout=5)
    assert dog.verdict({"jaxpar/heartbeat/1": "beat 7"}, now=100.0) is None  # first seen
    assert dog.verdict({"jaxpar/heartbeat/1": "beat 7"}, now=105.0) is None  # exactly the timeout
    why = dog.verdict({"jaxpar/heartbeat/1": "beat 7"}, now=105.1)
    assert why.startswith("process 1 of 2 sent no heartbeat for 5 s (distributed.heartbeat_timeout_s)")


def test_verdict_keeps_quiet_while_the_peer_beats_or_is_done():
    dog = _dog(timeout=5)
    for t in range(0, 60, 4):  # a new beat every 4 s, under the 5 s timeout
        assert dog.verdict({"jaxpar/heartbeat/1": f"beat {t}", "jaxpar/heartbeat/0": "beat 1"}, now=float(t)) is None
    assert dog.verdict({"jaxpar/heartbeat/1": "done"}, now=1000.0) is None  # finished: never lost
    never = _dog(timeout=5)  # a peer that never posted counts from when this process first looked
    assert never.verdict({}, now=0.0) is None
    assert "process 1 of 2 sent no heartbeat" in never.verdict({}, now=5.5)


def test_verdict_names_a_process_that_failed():
    why = _dog().verdict({"jaxpar/heartbeat/1": "failed: OSError: disk full"}, now=0.0)
    assert why == "process 1 of 2 stopped on an error: OSError: disk full"


def test_watchdog_thread_exits_naming_the_lost_process(capsys):
    store = Store()
    store.values["jaxpar/heartbeat/1"] = "beat 7"  # and never again
    dog = _dog(store).start()
    assert dog.exited.wait(timeout=120)  # no upper bound on how late: only that it happens
    dog.stop()
    assert dog.exits == [LOST_PEER_EXIT]
    assert "jaxpar: process 0: process 1 of 2 sent no heartbeat for 0.3 s" in capsys.readouterr().err


def test_watchdog_thread_reports_a_failed_process_and_a_lost_coordinator(capsys):
    store = Store()
    store.values["jaxpar/heartbeat/1"] = "failed: OSError: disk full"
    dog = _dog(store, timeout=0.1).start()
    assert dog.exited.wait(timeout=120)
    assert dog.exits == [LOST_PEER_EXIT] and "process 1 of 2 stopped on an error: OSError: disk full" in capsys.readouterr().err
    down = Store()
    down.down = True
    dog = _dog(down).start()
    assert dog.exited.wait(timeout=120)
    assert dog.exits == [LOST_PEER_EXIT] and "lost the coordinator (process 0)" in capsys.readouterr().err


def test_watchdog_thread_lets_a_finished_process_go_and_says_done_when_stopped(capsys):
    store = Store()
    store.values["jaxpar/heartbeat/1"] = "done"
    dog = _dog(store).start()
    while int(store.values.get("jaxpar/heartbeat/0", "beat 0").split()[1]) < 20:  # 20 looks, however slow
        assert dog._thread.is_alive() and not dog.exits, dog.exits
        time.sleep(0.01)
    dog.stop()
    assert dog.exits == [] and capsys.readouterr().err == ""
    assert store.values["jaxpar/heartbeat/0"] == "done"  # stop() tells the others


def test_the_cause_named_is_the_killed_process_not_the_one_its_death_aborted():
    """first_cause on made-up exits: (process, return code as Popen gives it, time seen)."""
    from jaxpar.launch import Exit, first_cause

    abort, kill, term = -signal.SIGABRT, -signal.SIGKILL, -signal.SIGTERM
    assert first_cause([Exit(0, 0, 1.0), Exit(1, 0, 1.0)]) is None
    # Seen in one poll, or one poll apart: the signal from outside, not the abort it provoked.
    assert first_cause([Exit(0, abort, 1.0), Exit(1, kill, 1.0)]).process == 1
    assert first_cause([Exit(0, 134, 1.0), Exit(1, kill, 1.1)]).process == 1
    assert first_cause([Exit(1, abort, 1.0), Exit(0, term, 1.2)]).process == 0
    assert first_cause([Exit(0, abort, 1.0), Exit(2, 2, 1.1), Exit(1, abort, 1.1)]).process == 2  # an error exit
    # Long after: the abort came first and is the cause.
    assert first_cause([Exit(0, abort, 1.0), Exit(1, kill, 9.0)]).process == 0
    # Alike: the earliest seen, then the lowest index.
    assert first_cause([Exit(1, 2, 1.0), Exit(0, 2, 1.1)]).process == 1
    assert first_cause([Exit(1, 2, 1.0), Exit(0, 2, 1.0)]).process == 0
    # A lost peer's exit is an echo: the cause only when nothing else failed.
    assert first_cause([Exit(0, LOST_PEER_EXIT, 1.0), Exit(1, kill, 5.0)]).process == 1
    assert first_cause([Exit(0, LOST_PEER_EXIT, 1.0), Exit(1, 0, 5.0)]).process == 0


def test_the_launcher_names_a_killed_process_whose_death_aborted_another_at_once(capsys):
    """Two tiny Python children: process 1 holds a pipe and is killed; process 0 reads the
    pipe and aborts the moment it closes, as gloo aborts when its peer's socket closes. Both
    go within one poll; the launcher names process 1 and exits 137."""
    from jaxpar.launch import Relay, _supervise

    read, write = os.pipe()
    reader = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
              "os.read(int(sys.argv[1]), 1); os.abort()")
    killed = "import os, signal, time; time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)"
    procs = [subprocess.Popen([sys.executable, "-c", reader, str(read)], pass_fds=(read,)),
             subprocess.Popen([sys.executable, "-c", killed], pass_fds=(write,))]
    os.close(read)
    os.close(write)
    assert _supervise(procs, grace_s=30, asked=[], relay=Relay(verbose=False)) == 128 + signal.SIGKILL
    err = capsys.readouterr().err.splitlines()
    assert err == ["jaxpar launch: process 1 was killed by SIGKILL",
                   "jaxpar launch: then process 0 was killed by SIGABRT"]


# ------------------------------------------------------------------ real processes

TINY = ["model.num_layers=1", "train.seq_len=32", "train.global_batch=16", "train.compute_dtype=float32"]


def _cli(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "jaxpar.commands", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _sets(items):
    return [x for s in items for x in ("--set", s)]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _listening_addresses(port):
    """Local addresses of the sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


def test_a_process_that_stops_responding_stops_the_other_in_time_and_the_coordinator_is_on_loopback(tmp_path):
    """Process 1 is frozen (SIGSTOP): alive, its sockets open, silent. Process 0's watchdog
    names it and exits; the launcher ends the frozen one after --grace. (A process killed
    outright can also end the other through gloo, which aborts a collective whose peer
    vanished: that race is why the silent peer is the one tested.)"""
    timeout = 5
    metrics = tmp_path / "m.jsonl"
    sets = _sets(TINY + ["train.steps=100000", "mesh.data=4", "mesh.tensor=2", f"distributed.heartbeat_timeout_s={timeout}"])
    launched = _cli("launch", "--nproc", "2", "--cpu-devices-per-proc", "4", "--grace", "2", "--",
                    "train", "llama", "--no-progress", "--metrics-file", str(metrics), *sets)
    try:
        _freeze_one_and_watch(launched, metrics, timeout)
    finally:
        if launched.poll() is None:  # a failed check must not leave a training run behind
            launched.send_signal(signal.SIGTERM)
            launched.wait(timeout=30)


def _freeze_one_and_watch(launched, metrics, timeout):
    import re

    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(launched.stderr), daemon=True).start()
    deadline = time.monotonic() + 300
    while len(_rows(metrics)) < 2:
        assert launched.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, "no steps after 300 s"
        time.sleep(0.05)
    text = "".join(lines)
    pids = dict(enumerate(map(int, re.search(r"2 processes, pids (\d+) (\d+) \(coordinator", text).groups())))
    port = int(re.search(r"coordinator 127\.0\.0\.1:(\d+)", text).group(1))
    if sys.platform.startswith("linux"):
        loopback = ("0100007F", "0000000000000000FFFF00000100007F")  # 127.0.0.1, as IPv4 or IPv4-mapped IPv6
        assert _listening_addresses(port) and all(a in loopback for a in _listening_addresses(port))
    frozen = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    launched.wait(timeout=timeout + 120)
    print(f"the launcher ended {time.monotonic() - frozen:.1f} s after process 1 froze (timeout {timeout} s)")
    text = "".join(lines)
    assert "jaxpar: process 0: process 1 of 2 sent no heartbeat for 5 s" in text
    assert f"process 0 exited with status {LOST_PEER_EXIT}" in text
    assert "process 1 still runs 2 s on; killing it" in text and "process 1 was killed by SIGKILL" in text
    assert launched.returncode == 128 + signal.SIGKILL  # the cause: process 1, not process 0's echo of it


def test_each_process_reads_only_its_rows(tmp_path, tiny_llama):
    """Two processes of 4 devices joined by hand (the JAXPAR_* variables, the port reserved as
    the launcher does) each read half the batch from the token file; the global batch they
    assemble is the one a single process reads. Then they train data=2 x fsdp=2 x tensor=2,
    whose reductions all have 2 members (tests/multiprocess_rows.py), and this process of 8
    does the same meanwhile, with XLA's in-process collectives: losses and final parameters
    are equal to the byte. (A layout with wider reductions, data=4 x tensor=2:
    test_sigterm_saves_at_an_agreed_step_and_two_processes_resumed_equal_one_bitwise.)"""
    from jaxpar.distributed import reserved_port

    import multiprocess_rows as probe

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 128, 5000).astype(np.uint16))
    script = os.path.join(os.path.dirname(__file__), "multiprocess_rows.py")
    with reserved_port("127.0.0.1") as port:  # held until process 0's coordinator binds it too
        env = {**os.environ, "JAXPAR_COORDINATOR": f"127.0.0.1:{port}", "JAXPAR_COORDINATOR_BIND": f"127.0.0.1:{port}",
               "JAXPAR_NUM_PROCESSES": "2"}
        procs = [subprocess.Popen([sys.executable, script, str(tokens), str(tmp_path / f"report{i}.json")],
                                  env={**env, "JAXPAR_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(2)]
        try:
            here = {name: probe.train(overrides) for name, overrides in probe.LAYOUTS.items()}
        finally:
            outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    reports = [json.loads((tmp_path / f"report{i}.json").read_text()) for i in range(2)]
    assert [r["read_rows"] for r in reports] == [[[0, 8]], [[8, 16]]]

    from jaxpar.config import apply_overrides
    from jaxpar.data.sources import make_source
    from jaxpar.train import build
    trainer = build(apply_overrides(tiny_llama, ["mesh.data=8", "data.source=tokens", f"data.path={tokens}"]))
    alone = make_source(trainer.batch, trainer.config)
    want = np.asarray(alone(3)["inputs"])
    for r in reports:
        np.testing.assert_array_equal(np.asarray(r["inputs"]), want)

    assert reports[0]["losses"] == reports[1]["losses"] == {name: losses for name, (losses, _) in here.items()}
    two = np.load(tmp_path / "report0.json.npz")
    assert sorted(two.files) == sorted(f"{name}/{path}" for name, (_, params) in here.items() for path in params)
    for name, (_, params) in here.items():
        for path, value in params.items():  # bytes, not values: -0.0 and 0.0 differ too
            assert value.dtype == np.float32 and value.tobytes() == two[f"{name}/{path}"].tobytes(), (name, path)


def test_sigterm_saves_at_an_agreed_step_and_two_processes_resumed_equal_one_bitwise(tmp_path):
    """data=4 x tensor=2, the data axis across 2 processes of 4 devices. SIGTERM to the
    launcher reaches both; JAX's preemption service picks one step for both, they save it
    and exit 143; the same command resumes. Every loss and gradient norm equals those of one
    process of 8 devices running uninterrupted with JAXPAR_CPU_COLLECTIVES=gloo, bitwise:
    the gradients are summed over 4 devices, in gloo's ring order in both (XLA's in-process
    all-reduce, in rank order, differs in the last bits; docs/distributed.md)."""
    import re

    ckpt, metrics, alone = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "alone.jsonl"
    layout = TINY + ["train.steps=16", "mesh.data=4", "mesh.tensor=2"]
    command = ("launch", "--nproc", "2", "--cpu-devices-per-proc", "4", "--",
               "train", "llama", "--no-progress", "--metrics-file", str(metrics), *_sets(layout + [f"checkpoint.dir={ckpt}"]))
    launched = _cli(*command)
    deadline = time.monotonic() + 300
    while len(_rows(metrics)) < 3:
        assert launched.poll() is None and time.monotonic() < deadline, launched.stderr.read()[-3000:]
        time.sleep(0.05)
    launched.send_signal(signal.SIGTERM)
    _, err = launched.communicate(timeout=300)
    assert launched.returncode == 143, err[-3000:]
    saved = int(re.search(r"preempted after step (\d+): saved step \d+ to", err).group(1))
    assert 3 <= saved < 16 and "process 1 exited with status 143" in err
    resumed = _cli(*command)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert "[Gloo]" not in out + err and "peer ranks" not in out + err  # Gloo's chatter, left out by the launcher
    assert f"resumed from step {saved}" in out and "on 8 cpu devices in 2 processes" in out
    one = _cli("train", "llama", "--no-progress", "--metrics-file", str(alone), *_sets(layout),
               env={**os.environ, "JAXPAR_CPU_COLLECTIVES": "gloo"})
    out, err = one.communicate(timeout=600)
    assert one.returncode == 0, err[-3000:]
    assert "on 8 cpu devices |" in out  # one process: a cluster of one, not announced as several
    two = _rows(metrics)
    assert [r["step"] for r in two] == list(range(1, 17))  # the steps done
    assert [(r["loss"], r["grad_norm"]) for r in two] == [(r["loss"], r["grad_norm"]) for r in _rows(alone)]


def test_a_launch_that_fails_says_why_once():
    """3 processes x 2 devices: the recipe's mesh cannot fill 6 devices. Every process
    refuses it, and the ones still joined to the dead coordinator abort in C++: the output
    is the error once, the first failure, and one line for the rest."""
    import re

    launched = _cli("launch", "--nproc", "3", "--", "train", "llama", "--no-progress", *_sets(TINY))
    out, err = launched.communicate(timeout=300)
    lines = err.splitlines()
    assert launched.returncode == 2, err[-3000:]
    assert out == "" and len(lines) == 4, err[-3000:]  # before: about 40 lines of aborts, gRPC and absl
    assert re.fullmatch(r"jaxpar launch: 3 processes, pids \d+ \d+ \d+ \(coordinator 127\.0\.0\.1:\d+\)", lines[0])
    assert re.fullmatch(r"(\[process \d\] )?jaxpar: error: mesh\.data=-1 cannot fill 6 devices: .*", lines[1])
    first = re.fullmatch(r"jaxpar launch: process (\d) exited with status 2", lines[2])
    ended = r"process (\d) (?:exited with status \d+|was killed by SIG[A-Z]+)"  # its own error, or torn down
    rest = re.fullmatch(rf"jaxpar launch: then {ended}, {ended}", lines[3])
    assert first and rest and {first.group(1), *rest.groups()} == {"0", "1", "2"}, err


def test_launched_processes_stop_when_the_launcher_dies():
    """jaxpar.launch.follow_launcher: a child whose launcher is killed outright gets SIGTERM
    from the kernel (Linux's parent-death signal; elsewhere follow_launcher does nothing).
    Here a plain Python child, not a training run: the mechanism alone."""
    from jaxpar.launch import LAUNCHER_PID, follow_launcher

    if not sys.platform.startswith("linux"):
        assert follow_launcher({LAUNCHER_PID: "1"}) is None
        return
    child = ("import os, time; from jaxpar.launch import follow_launcher; "
             "follow_launcher(); print('following', os.getpid(), flush=True); time.sleep(600)")
    launcher = (f"import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}], "
                f"env={{**os.environ, {LAUNCHER_PID!r}: str(os.getpid())}}); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    word, pid = parent.stdout.readline().split()  # the child has asked the kernel
    assert word == "following"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 120
    while _alive(int(pid)):
        assert time.monotonic() < deadline, "the child outlived its launcher by 120 s"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Running, neither gone nor a zombie waiting for its (new) parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_bad_distributed_settings_are_refused_before_joining():
    """No coordinator is listening: the run must be refused by the rule, not wait to join."""
    env = {**os.environ, "JAXPAR_COORDINATOR": "127.0.0.1:9", "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "1"}
    proc = subprocess.run([sys.executable, "-m", "jaxpar.commands", "train", "llama", "--set", "distributed.heartbeat_timeout_s=0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "distributed.heartbeat_timeout_s=0 must be a positive number" in proc.stderr
