"""Run by tests/scenarios/test_distributed.py as one of two processes of 4 CPU devices (JAXPAR_*
variables set): `multiprocess_rows.py TOKENS REPORT`. Join, then

- build a trainer on data=4 x tensor=2 and record the batch rows this process reads from
  the token file and the whole global batch gathered back (to compare with a single
  process reading every row);
- train each of LAYOUTS for STEPS steps on the default synthetic data and record the losses
  (to compare bitwise with one process of 8 devices, where `train` runs too).

Each process writes REPORT (JSON); process 0 also REPORT.npz, the final float32 parameters
by layout and path. Files, not stdout: gloo prints there.
"""

import json
import pathlib
import sys

STEPS = 2
# Layouts whose every reduction (all-reduce, reduce-scatter) has 2 members: bitwise the same
# sum whatever the implementation (a + b = b + a), so equal to one process with XLA's
# in-process collectives. With more members see docs/distributed.md.
LAYOUTS = {  # each costs a compile in every process; fsdp=2 x context=2 (ring) x tensor=2 passed too
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}


def config():
    from jaxpar.config import Config, TrainConfig
    from jaxpar.models.llama import LlamaConfig

    return Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
        train=TrainConfig(steps=STEPS, global_batch=16, seq_len=16, compute_dtype="float32"),
    )


def train(overrides: list[str]) -> tuple[list[float], dict]:
    """STEPS steps of the tiny model under `overrides`: the losses and the final float32
    parameters (gathered to every process, by path)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxpar.config import apply_overrides
    from jaxpar.data.sources import make_source
    from jaxpar.train import build

    trainer = build(apply_overrides(config(), overrides))
    data = make_source(trainer.batch, trainer.config)
    state = trainer.init()
    losses = []
    for step in range(STEPS):
        state, metrics = trainer.step(state, data(step))
        losses.append(float(metrics["loss"]))
    master = multihost_utils.process_allgather(trainer.model_order(trainer.master_params(state)), tiled=True)
    return losses, {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
                    for path, leaf in jax.tree_util.tree_flatten_with_path(master)[0]}


def main(tokens: str, report_path: str) -> None:
    from jaxpar import distributed
    from jaxpar.mesh import force_cpu_devices

    force_cpu_devices(4)
    distributed.join(distributed.from_environment(), heartbeat_timeout_s=30, join_timeout_s=60)

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxpar.config import apply_overrides
    from jaxpar.data.sources import make_source
    from jaxpar.train import build

    rows = ["mesh.data=4", "mesh.tensor=2", "data.source=tokens", f"data.path={tokens}"]
    trainer = build(apply_overrides(config(), rows))
    source = make_source(trainer.batch, trainer.config)
    read = []
    local = source.local
    source.local = lambda step, rows: read.append([rows.start, rows.stop]) or local(step, rows)
    batch = source(3)
    whole = multihost_utils.process_allgather(batch["inputs"], tiled=True)
    report = {"process": jax.process_index(), "read_rows": read, "inputs": np.asarray(whole).tolist(), "losses": {}}
    params = {}
    for name, overrides in LAYOUTS.items():
        report["losses"][name], trained = train(overrides)
        params.update({f"{name}/{path}": value for path, value in trained.items()})
    if jax.process_index() == 0:
        np.savez(report_path + ".npz", **params)
    pathlib.Path(report_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
