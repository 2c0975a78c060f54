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
    with pytest.raises(ConfigError, match="runs `train`"):
        child_command(2, ["explain", "llama"], 4)
    with pytest.raises(ConfigError, match="--cpu-devices-per-proc"):
        child_command(2, ["train", "llama", "--cpu-devices", "4"], 4)
    with pytest.raises(ConfigError, match="--nproc=0"):
        child_command(0, ["train", "llama"], 4)
    assert child_command(2, ["train", "llama"], 3)[-2:] == ["--cpu-devices", "3"]


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


def _watch(store, capsys, peer_value=None, timeout=0.3):
    """Process 0 of 2 watching; returns (exit status or None, stderr) after ~1 s."""
    exits = []
    dog = Watchdog(timeout, interval_s=0.02, client=store, process_id=0, num_processes=2)
    dog.exit = exits.append
    if peer_value is not None:
        store.values["jaxpar/heartbeat/1"] = peer_value
    dog.start()
    time.sleep(1.0)
    dog.stop()
    return (exits[0] if exits else None), capsys.readouterr().err


def test_watchdog_names_a_process_that_stopped_beating(capsys):
    status, err = _watch(Store(), capsys, peer_value="beat 7")
    assert status == LOST_PEER_EXIT
    assert "process 1 of 2 sent no heartbeat for 0.3 s" in err


def test_watchdog_names_a_process_that_failed(capsys):
    status, err = _watch(Store(), capsys, peer_value="failed: OSError: disk full", timeout=0.1)
    assert status == LOST_PEER_EXIT and "process 1 of 2 stopped on an error: OSError: disk full" in err


def test_watchdog_lets_a_finished_process_go_and_reports_a_lost_coordinator(capsys):
    status, err = _watch(Store(), capsys, peer_value="done")
    assert status is None and err == ""
    store = Store()
    store.down = True
    status, err = _watch(store, capsys)
    assert status == LOST_PEER_EXIT and "lost the coordinator (process 0)" in err


def test_watchdog_keeps_quiet_while_the_peer_beats(capsys):
    store = Store()
    beating = threading.Event()

    def beat():
        n = 0
        while not beating.is_set():
            n += 1
            store.key_value_set("jaxpar/heartbeat/1", f"beat {n}")
            time.sleep(0.05)

    threading.Thread(target=beat, daemon=True).start()
    status, err = _watch(store, capsys)
    beating.set()
    assert status is None and err == ""
    assert store.values["jaxpar/heartbeat/0"] == "done"  # stop() tells the others


# ------------------------------------------------------------------ real processes

TINY = ["model.num_layers=1", "train.seq_len=32", "train.global_batch=16", "train.compute_dtype=float32"]


def _cli(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "jaxpar.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _sets(items):
    return [x for s in items for x in ("--set", s)]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_processes_of_four_devices_equal_one_of_eight(tmp_path):
    """data=2 x fsdp=2 x tensor=2: the data axis spans the processes. Bitwise equal losses
    and gradient norms at every step."""
    sets = _sets(TINY + ["train.steps=4", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
    launched = _cli("launch", "--nproc", "2", "--cpu-devices-per-proc", "4", "--",
                    "train", "llama", "--no-progress", "--metrics-file", str(two), *sets)
    out, err = launched.communicate(timeout=600)
    assert launched.returncode == 0, err[-3000:]
    assert "on 8 cpu devices in 2 processes" in out
    alone = _cli("train", "llama", "--no-progress", "--metrics-file", str(one), *sets)
    assert alone.wait(timeout=600) == 0, alone.stderr.read()[-3000:]
    a, b = _rows(one), _rows(two)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]


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


def test_a_killed_process_stops_the_other_in_time_and_the_coordinator_is_on_loopback(tmp_path):
    timeout = 5
    metrics = tmp_path / "m.jsonl"
    sets = _sets(TINY + ["train.steps=100000", "mesh.data=4", "mesh.tensor=2", f"distributed.heartbeat_timeout_s={timeout}"])
    launched = _cli("launch", "--nproc", "2", "--cpu-devices-per-proc", "4", "--",
                    "train", "llama", "--no-progress", "--metrics-file", str(metrics), *sets)
    try:
        _kill_one_and_watch(launched, metrics, timeout)
    finally:
        if launched.poll() is None:  # a failed check must not leave a training run behind
            launched.send_signal(signal.SIGTERM)
            launched.wait(timeout=30)


def _kill_one_and_watch(launched, metrics, timeout):
    import re

    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(launched.stderr), daemon=True).start()
    deadline = time.monotonic() + 300
    while len(_rows(metrics)) < 2:
        assert launched.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, "no steps after 300 s"
        time.sleep(0.05)
    text = "".join(lines)
    pids = {int(i): int(p) for i, p in re.findall(r"process (\d) of 2 is pid (\d+)", text)}
    port = int(re.search(r"coordinator 127\.0\.0\.1:(\d+)", text).group(1))
    if sys.platform.startswith("linux"):
        loopback = ("0100007F", "0000000000000000FFFF00000100007F")  # 127.0.0.1, as IPv4 or IPv4-mapped IPv6
        assert _listening_addresses(port) and all(a in loopback for a in _listening_addresses(port))
    killed = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    launched.wait(timeout=timeout + 60)
    took = time.monotonic() - killed
    text = "".join(lines)
    print(f"process 0 exited {took:.1f} s after process 1 was killed (timeout {timeout} s)")
    assert took < timeout + 15, took
    assert "process 1 was killed by SIGKILL" in text
    assert "jaxpar: process 0: process 1 of 2 sent no heartbeat for 5 s" in text
    assert f"process 0 exited with status {LOST_PEER_EXIT}" in text
    assert launched.returncode == 128 + signal.SIGKILL


def test_each_process_reads_only_its_rows(tmp_path, tiny_llama):
    """Two processes joined by hand (the JAXPAR_* variables) each read half the batch from
    the token file; the global batch they assemble is the one a single process reads."""
    from jaxpar.launch import free_port

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 128, 5000).astype(np.uint16))
    port = free_port("127.0.0.1")
    env = {**os.environ, "JAXPAR_COORDINATOR": f"127.0.0.1:{port}", "JAXPAR_COORDINATOR_BIND": f"127.0.0.1:{port}",
           "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "0"}
    probe = os.path.join(os.path.dirname(__file__), "multiprocess_rows.py")
    procs = [subprocess.Popen([sys.executable, probe, str(tokens)], env={**env, "JAXPAR_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["read_rows"] for r in reports] == [[[0, 8]], [[8, 16]]]

    from jaxpar.config import apply_overrides
    from jaxpar.data.sources import make_source
    from jaxpar.train import build
    alone = make_source(build(apply_overrides(tiny_llama, ["mesh.data=8", "data.source=tokens", f"data.path={tokens}"])))
    want = np.asarray(alone(3)["inputs"])
    for r in reports:
        np.testing.assert_array_equal(np.asarray(r["inputs"]), want)


def test_sigterm_saves_at_an_agreed_step_and_the_resumed_run_repeats_the_losses(tmp_path):
    """SIGTERM to the launcher reaches both processes; JAX's preemption service picks one
    step for both, they save it and exit 143; the same command resumes, and every loss
    equals the uninterrupted run's, bitwise."""
    import re

    ckpt, metrics, alone = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "alone.jsonl"
    sets = _sets(TINY + ["train.steps=30", "mesh.data=4", "mesh.tensor=2", f"checkpoint.dir={ckpt}"])
    command = ("launch", "--nproc", "2", "--cpu-devices-per-proc", "4", "--",
               "train", "llama", "--no-progress", "--metrics-file", str(metrics), *sets)
    launched = _cli(*command)
    deadline = time.monotonic() + 300
    while len(_rows(metrics)) < 3:
        assert launched.poll() is None and time.monotonic() < deadline, launched.stderr.read()[-3000:]
        time.sleep(0.05)
    launched.send_signal(signal.SIGTERM)
    _, err = launched.communicate(timeout=300)
    assert launched.returncode == 143, err[-3000:]
    saved = int(re.search(r"preempted after step (\d+): saved step \d+ to", err).group(1))
    assert 3 <= saved < 30 and "process 1 exited with status 143" in err
    resumed = _cli(*command)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed from step {saved}" in out
    reference = _cli(*command[:9], "--metrics-file", str(alone), *_sets(TINY + ["train.steps=30", "mesh.data=4", "mesh.tensor=2"]))
    assert reference.wait(timeout=600) == 0, reference.stderr.read()[-3000:]
    assert [(r["step"], r["loss"]) for r in _rows(metrics)] == [(r["step"], r["loss"]) for r in _rows(alone)]


def test_bad_distributed_settings_are_refused_before_joining():
    """No coordinator is listening: the run must be refused by the rule, not wait to join."""
    env = {**os.environ, "JAXPAR_COORDINATOR": "127.0.0.1:9", "JAXPAR_NUM_PROCESSES": "2", "JAXPAR_PROCESS_ID": "1"}
    proc = subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "llama", "--set", "distributed.heartbeat_timeout_s=0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "distributed.heartbeat_timeout_s=0 must be a positive number" in proc.stderr
