"""Run by tests/test_distributed.py as one of two processes (JAXPAR_* variables set):
`multiprocess_rows.py TOKENS REPORT`. Join, build a trainer on data=4 x tensor=2 over both
processes' devices, and write to REPORT as JSON the batch rows this process reads from the
token file and the whole global batch gathered back (to compare with a single process
reading every row). A file, not stdout: native libraries (gloo) print there too."""

import json
import pathlib
import sys

from jaxpar import distributed
from jaxpar.mesh import force_cpu_devices

force_cpu_devices(4)
distributed.join(distributed.from_environment(), heartbeat_timeout_s=30, join_timeout_s=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxpar.config import Config, DataConfig, TrainConfig  # noqa: E402
from jaxpar.data.sources import make_source  # noqa: E402
from jaxpar.mesh import MeshConfig  # noqa: E402
from jaxpar.train import build  # noqa: E402
from jaxpar.models.llama import LlamaConfig  # noqa: E402

config = Config(
    model=LlamaConfig(vocab_size=128, embed=32, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
    train=TrainConfig(global_batch=16, seq_len=16, compute_dtype="float32"),
    mesh=MeshConfig(data=4, tensor=2),
    data=DataConfig(source="tokens", path=sys.argv[1]),
)
source = make_source(build(config))
read = []
local = source.local
source.local = lambda step, rows: read.append([rows.start, rows.stop]) or local(step, rows)
batch = source(3)
whole = multihost_utils.process_allgather(batch["inputs"], tiled=True)
pathlib.Path(sys.argv[2]).write_text(json.dumps({
    "process": jax.process_index(),
    "read_rows": read,
    "inputs": np.asarray(whole).tolist(),
}))
