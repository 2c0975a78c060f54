"""Token corpora of many shards (data.path a folder: jaxpar.data.shards): a process's resident
memory and its time to the first batch, for a small and a large generated corpus, so that
memory can be seen not to grow with the corpus.

Generates (once, into --dir) uint16 token shards of random ids below 32,000: --shards files
holding --gb GB in all, and a tenth of it (a tenth of the shards) beside. Each measurement
runs in a fresh process: it builds a tiny Llama's trainer (vocabulary 32,000), opens the
folder as data.source=tokens (every id checked against the vocabulary, as a run does), draws
the first batch, then 50 more, and reports the time to the first batch and the peak
resident memory (ru_maxrss) before opening and at the end. Both orders are measured:
windows (random starts) and epochs (a permutation of every row of the corpus, which does
grow with it: 8 bytes a row).

  python benchmarks/data_scale.py [--gb 10] [--shards 1000] [--dir /tmp/jaxpar_corpus]
  (writes benchmarks/results/data_scale.json; the generated shards stay in --dir)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_checks import write  # noqa: E402

VOCAB = 32000

MEASURE = r"""
import json, resource, sys, time
from jaxpar.mesh import force_cpu_devices
force_cpu_devices(1)
from jaxpar.config import Config, TrainConfig, apply_overrides
from jaxpar.models.llama import LlamaConfig
from jaxpar.data.sources import make_source
from jaxpar.train import build
path, order = sys.argv[1], sys.argv[2]
config = apply_overrides(Config(model=LlamaConfig(vocab_size=32000, embed=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                                 head_dim=16, mlp=64),
                                train=TrainConfig(global_batch=32, seq_len=2048, steps=1000)),
                         ["data.source=tokens", f"data.path={path}", f"data.order={order}"])
trainer = build(config)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
source = make_source(trainer.batch, config)
opened = time.perf_counter() - t0
source.local(0, slice(0, 32))
first = time.perf_counter() - t0
for step in range(1, 51):
    source.local(step, slice(0, 32))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tokens": len(source.tokens), "files": source.files, "open_s": opened, "first_batch_s": first,
                  "rss_before_mb": before / 1024, "rss_after_mb": after / 1024}))
"""


def generate(folder: pathlib.Path, shards: int, gb: float) -> None:
    """`shards` .npy files of uint16 ids, `gb` GB in all (skipped where they exist)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    per = int(gb * 1e9 / 2 / shards)
    t0 = time.time()
    for i in range(shards):
        target = folder / f"{i:05d}.npy"
        if not target.exists() or target.stat().st_size < per * 2:
            np.save(target, np.random.default_rng(i).integers(0, VOCAB, per, dtype=np.uint16))
    print(f"{folder}: {shards} shards of {per:,} tokens ({time.time() - t0:.0f} s)", file=sys.stderr)


def measure(folder: pathlib.Path, order: str) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(folder), order], capture_output=True, text=True,
                         cwd=ROOT, timeout=3600, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=10.0)
    p.add_argument("--shards", type=int, default=1000)
    p.add_argument("--dir", default="/tmp/jaxpar_corpus")
    p.add_argument("--out", default="benchmarks/results/data_scale.json")
    args = p.parse_args()
    root = pathlib.Path(args.dir)
    corpora = {"small": (root / "small", args.shards // 10, args.gb / 10), "large": (root / "large", args.shards, args.gb)}
    for folder, shards, gb in corpora.values():
        generate(folder, shards, gb)
    rows = []
    print(f"{'corpus':<7} {'order':<8} {'files':>6} {'tokens':>15} {'open':>8} {'first batch':>12} "
          f"{'RSS before':>11} {'RSS after':>10}")
    for name, (folder, shards, gb) in corpora.items():
        for order in ("windows", "epochs"):
            r = {"corpus": name, "gb": gb, "order": order, **measure(folder, order)}
            rows.append(r)
            print(f"{name:<7} {order:<8} {r['files']:>6} {r['tokens']:>15,} {r['open_s']:>7.1f}s "
                  f"{r['first_batch_s']:>11.1f}s {r['rss_before_mb']:>9.0f}MB {r['rss_after_mb']:>8.0f}MB", flush=True)
    write(dict(platform=platform.platform(), rows=rows, command="python benchmarks/data_scale.py " + " ".join(sys.argv[1:]),
               note="the corpus was just written, so its pages may sit in the page cache: a cold disk reads slower"),
          pathlib.Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
