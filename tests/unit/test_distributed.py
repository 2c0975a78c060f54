"""Several processes (jaxpar.distributed, jaxpar.launch): finding the cluster in the
environment, the watchdog, and real runs of 2 processes x 4 CPU devices over gloo.

Here what needs no process started; the real processes (launch, kill, freeze, preemption):
tests/scenarios/test_distributed.py."""

import signal
import sys
import threading
import time

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
