"""Several processes (jaxpar.distributed, jaxpar.launch): finding the cluster in the
environment, the watchdog, and real runs of 2 processes x 4 CPU devices over gloo.

Here the processes started (launch, kill, freeze, preemption); the environment and the
watchdog on made-up inputs: tests/unit/test_distributed.py."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxpar.distributed import LOST_PEER_EXIT

# ------------------------------------------------------------------ the watchdog


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


@pytest.mark.smoke  # the smoke tier: several processes
def test_each_process_reads_only_its_rows(tmp_path, tiny_llama):
    """Two processes of 4 devices joined by hand (the JAXPAR_* variables, the port reserved as
    the launcher does) each read half the batch from the token file; the global batch they
    assemble is the one a single process reads. Then they train data=2 x fsdp=2 x tensor=2,
    whose reductions all have 2 members (tests/scenarios/multiprocess_rows.py), and this process of 8
    does the same meanwhile, with XLA's in-process collectives: losses and final parameters
    are equal to the byte. (A layout with wider reductions, data=4 x tensor=2:
    test_sigterm_saves_at_an_agreed_step_and_two_processes_resumed_equal_one_bitwise.)"""
    from jaxpar.distributed import reserved_port

    from . import multiprocess_rows as probe

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
    assert re.fullmatch(r"(\[process \d\] )?jaxpar: error: mesh\.fsdp=2 x mesh\.tensor=2 = 4 does not divide the 6 devices.*", lines[1])
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
