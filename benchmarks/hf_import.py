"""Peak host memory of a Hugging Face import, against the checkpoint's size.

Makes a Llama-shaped checkpoint (bfloat16, several safetensors files and an index), then
imports it into fsdp over 8 CPU devices (jaxpar.hf.prepare_import) in 1, 2 and 4 processes
joined by jax.distributed, each in a fresh child. Each process reports the bytes its
devices hold (its float32 shards: on CPU the devices' memory is host memory, so they count
in its RSS) and its peak RSS growth over the import (VmHWM after - VmRSS before). A
process reads only the slices its devices hold, so its growth follows its shards, not the
checkpoint. On CPU the growth is about 2.3x the shards held: the float32 slices read, the
state made from them and the mapped file pages all count; on a GPU only the first and the
last are host memory.

  python benchmarks/hf_import.py [--layers 8] [--embed 1024] [--out benchmarks/results/hf_import.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_checkpoint(folder: pathlib.Path, layers: int, embed: int) -> int:
    """A random Llama in Hugging Face's format (written with jaxpar's streaming writer)."""
    import ml_dtypes
    import numpy as np

    from jaxpar.hf.safetensors import Planned, file_names, plan_files, write_file
    from jaxpar.models.llama import LLAMA_FORMAT, LlamaConfig

    heads = embed // 64
    cfg = LlamaConfig(vocab_size=32000, embed=embed, num_layers=layers, num_heads=heads, num_kv_heads=heads // 2,
                      head_dim=64, mlp=4 * embed, tie_embeddings=False)
    shapes = {}
    for path, weight in LLAMA_FORMAT.weights(cfg).items():
        stacked = (layers,) if weight.stacked else ()
        ours = {"embedding": (32000, embed), "head": (embed, 32000), "final_norm.scale": (embed,)}.get(path)
        for combo, name in weight.names(stacked + (ours or _layer_shape(cfg, path))):
            shapes[name] = weight.hf_shape(ours or _layer_shape(cfg, path))
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    tensors = [Planned(n, bf16, s, lambda s=s: rng.normal(size=s).astype(bf16)) for n, s in sorted(shapes.items())]
    files = plan_files(tensors, 200 << 20)
    names = file_names(len(files))
    folder.mkdir(parents=True, exist_ok=True)
    for name, group in zip(names, files):
        write_file(folder / name, group, {"format": "pt"})
    index = {"weight_map": {t.name: n for n, g in zip(names, files) for t in g}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    hf = LLAMA_FORMAT.to_hf(cfg)
    (folder / "config.json").write_text(json.dumps(hf))
    return sum(t.nbytes for t in tensors)


def _layer_shape(cfg, path: str) -> tuple[int, ...]:
    d, h, kv, k, f = cfg.embed, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp
    return {"layers.attn.wq": (d, h, k), "layers.attn.wk": (d, kv, k), "layers.attn.wv": (d, kv, k),
            "layers.attn.wo": (h, k, d), "layers.attn_norm.scale": (d,), "layers.mlp_norm.scale": (d,),
            "layers.mlp.w_gate": (d, f), "layers.mlp.w_up": (d, f), "layers.mlp.w_down": (f, d)}[path]


def child(folder: str, process_id: int, processes: int, port: int) -> None:
    """One process of the import: join, build, import, report (as one JSON line)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // processes}"
    import jax

    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", processes, process_id, cluster_detection_method="deactivate")
    from jaxpar.config import Config, OptimConfig, TrainConfig
    from jaxpar.hf import model_config, prepare_import
    from jaxpar.mesh import MeshConfig
    from jaxpar.train import build

    config = Config(model=model_config(folder), mesh=MeshConfig(data=1, fsdp=8),
                    train=TrainConfig(global_batch=8, seq_len=64, compute_dtype="float32"),
                    optim=OptimConfig(name="sgd"))  # sgd: no optimizer state, the weights alone
    trainer = build(config)
    start = prepare_import(trainer, folder)
    before = _status("VmRSS")
    state = jax.block_until_ready(start())
    peak = _status("VmHWM")
    held = sum(s.data.nbytes for x in jax.tree.leaves(state.params) for s in x.addressable_shards)
    print(json.dumps({"process": process_id, "held_bytes": held, "rss_before": before, "peak_rss": peak}), flush=True)


def _status(key: str) -> int:
    """Bytes of a /proc/self/status field (VmRSS now, VmHWM the peak so far)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(folder: pathlib.Path, processes: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    children = [subprocess.Popen([sys.executable, __file__, "--child", str(folder), str(i), str(processes), str(port)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for i in range(processes)]
    reports = []
    for c in children:
        out, err = c.communicate(timeout=900)
        if c.returncode:
            raise SystemExit(f"a child failed:\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embed", type=int, default=1024)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_import.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "checkpoint"
        size = make_checkpoint(folder, args.layers, args.embed)
        print(f"checkpoint: {size / 2**20:.0f} MiB bfloat16 in {len(list(folder.glob('*.safetensors')))} files")
        print(f"{'processes':>9} {'shards held':>12} {'peak RSS growth':>16} {'growth / checkpoint':>20} {'growth / held':>14}")
        for processes in (1, 2, 4):
            for r in measure(folder, processes):
                growth = r["peak_rss"] - r["rss_before"]
                rows.append({"processes": processes, **r, "growth_bytes": growth, "checkpoint_bytes": size})
                if r["process"] == 0:
                    print(f"{processes:>9} {r['held_bytes'] / 2**20:>9.0f} MiB {growth / 2**20:>12.0f} MiB "
                          f"{growth / size:>20.2f} {growth / r['held_bytes']:>14.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": platform.node(), "cpu_count": os.cpu_count(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.path.insert(0, str(ROOT))
        main()
