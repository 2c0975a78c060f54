"""The composition matrix: every pair of strategies on different mesh axes, and the triples
real runs use, each trained for 3 fp32 steps through `jaxpar train` in a subprocess and
compared with the single-device run of the same recipe and shape.

  python benchmarks/matrix.py                      # every cell; table + benchmarks/results/matrix.json
  python benchmarks/matrix.py --list               # the cells and their overrides, nothing run
  python benchmarks/matrix.py --only 1f1b --only zero3 --jobs 2 --out /tmp/m.json
  python benchmarks/matrix.py --only deepseek      # DeepSeek-V3's family
  python benchmarks/matrix.py --only mistral       # a sliding window under context parallelism
  python benchmarks/matrix.py --only qwen3         # QK-norm while tensor + SP splits the heads
  python benchmarks/matrix.py --only gemma3        # local and global layers in one ring and one stage
  python benchmarks/matrix.py --only lora          # LoRA adapters under a strategy of each axis
  python benchmarks/matrix.py --only kv1 --only gemma3_1b   # key/value heads fewer than mesh.tensor
  python benchmarks/matrix.py --only qwen3_moe_dense           # dense layers among the MoE ones
  python benchmarks/matrix.py --only uneven --only two_batch    # stages of any size, the two-batch overlap
  python benchmarks/matrix.py --only fp8_experts   # FP8 experts and dispatch (to 1e-3: VARIANT_RTOL)
  python benchmarks/matrix.py --only two_hops      # node-limited routing: the expert axis over 2 hosts
  python benchmarks/matrix.py --only diloco        # DiLoCo's groups over data, a layout inside each

Strategies and their mesh axis (each gets DEGREE = 2 devices there; a pair runs on 4 CPU
devices, a triple on 8, so no axis the cell does not name is > 1):

  data: data, zero1, zero2, zero3 (parallel.zero.stage; ZeRO acts over data and fsdp),
        topk (parallel.compression.method=topk at fraction 1, lossless; mesh.hosts.data=2)
  fsdp: fsdp          tensor: tensor, tensor+sp (parallel.tensor.sequence_parallel)
  context: ring, ulysses, allgather (parallel.context.impl)       expert: expert
  stage: gpipe, 1f1b, interleaved (pipeline_chunks=2), zb-h1, 1f1b-overlap (parallel.pipeline.schedule)

Cells with `expert` use the moe recipe, the others the llama recipe, each with its own model
shape, seq_len and global batch; the cells marked [deepseek] (every pair with expert, and
pipeline x data x expert and fsdp x expert x tensor) run DeepSeek-V3's family in small
(recipes/deepseek.py: latent attention, DeepSeekMoE, multi-token prediction); the cells marked
[mistral] (ring beside every strategy but expert, and Ulysses x tensor, all-gather x fsdp) run
recipes/mistral.py (a sliding window of 16 keys, the ring in the contiguous order); the cells
marked [qwen3] (tensor+sp beside every strategy but expert) run recipes/qwen3.py (QK-norm,
wide heads); every run forces train.compute_dtype=float32,
train.steps=3, parallel.tensor.sequence_parallel=false (the llama recipe turns it on; only
tensor+sp does here) and the cell's mesh (all six axes named, so the recipe's own mesh is
replaced: jaxpar.recipes.resolve_config). Overrides a cell needs to be legal at all are listed
in its `adapted` field with the reason (pipelines: train.microbatches=2; expert x context:
model.routing=dropless), and the reference runs with them too.

A cell is
  equal    the 3 losses match the reference to RTOL, and so does every final parameter
           (max |difference| per array within RTOL x the array's largest magnitude, or x lr x
           steps where the array is smaller than Adam could move it, as a zero-started one; read
           from the checkpoint that checkpoint.dir makes the CLI write at the end);
  refused  `jaxpar train` exits 2 with its one-line ConfigError (recorded);
  failed   anything else: a signal (an XLA abort), a timeout, a traceback, a mismatch; the
           reason in one line and the tail of stderr are recorded.

The reference is `jaxpar train RECIPE --cpu-devices 1` with the same overrides but the
mesh and parallel.* ones (on one device every layout collapses), once per recipe and
adaptation. DiLoCo's cells ([diloco], [diloco_moe], [diloco_streaming]) keep its settings
and its groups in the reference: `--cpu-devices 2` with mesh.data=2, each group on one
device (jaxpar.testing.diloco_reference checks that against the groups run one after
another: tests/equivalence/test_diloco.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

ROOT = pathlib.Path(__file__).resolve().parents[1]
AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")  # jaxpar.mesh order, outermost first
DEGREE = 2
STEPS = 3
RTOL = 1e-5
TIMEOUT_S = 300
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "matrix.json"
BASE = ("train.compute_dtype=float32", f"train.steps={STEPS}")


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    axis: str
    sets: tuple[str, ...] = ()  # the parallel.* overrides that select it (besides mesh.<axis>=2)


PIPELINES = ("gpipe", "1f1b", "interleaved", "zb-h1", "1f1b-overlap")
STRATEGIES = (
    Strategy("data", "data"),
    *(Strategy(f"zero{k}", "data", (f"parallel.zero.stage={k}",)) for k in (1, 2, 3)),
    # gradient compression at its lossless setting (every entry): each data replica a host of
    # its own, the layer stack compressed layer by layer inside the backward pass
    Strategy("topk", "data", ("mesh.hosts.data=2", "parallel.compression.method=topk", "parallel.compression.topk_fraction=1")),
    Strategy("fsdp", "fsdp"),
    Strategy("tensor", "tensor"),
    Strategy("tensor+sp", "tensor", ("parallel.tensor.sequence_parallel=true",)),
    *(Strategy(impl, "context", (f"parallel.context.impl={impl}",)) for impl in ("ring", "ulysses", "allgather")),
    Strategy("expert", "expert"),
    *(Strategy(s, "stage", (f"parallel.pipeline.schedule={s}",) + (("parallel.pipeline.chunks=2",) if s == "interleaved"
                                                                   else ())) for s in PIPELINES),
)
BY_NAME = {s.name: s for s in STRATEGIES}
GROUPS = {axis: tuple(s.name for s in STRATEGIES if s.axis == axis) for axis in AXES}

# The triples a real run uses: every strategy of each group, in every combination.
TRIPLES = (
    (GROUPS["stage"], ("fsdp",), GROUPS["tensor"]),  # pipeline x fsdp x tensor
    (GROUPS["stage"], GROUPS["context"], GROUPS["tensor"]),  # pipeline x context x tensor
    (("fsdp",), GROUPS["context"], ("tensor+sp",)),  # fsdp x context x tensor + SP
    (("expert",), GROUPS["tensor"], ("fsdp",)),  # expert x tensor x fsdp
)


# DeepSeek-V3's family (recipes/deepseek.py: multi-head latent attention, DeepSeekMoE, multi-
# token prediction), run on the cells that split its experts: every strategy beside expert,
# and the triples DeepSeek-V3 and FSDP runs use.
DEEPSEEK_TRIPLES = (
    (GROUPS["stage"], ("data",), ("expert",)),  # pipeline x data x expert, as DeepSeek-V3 trained
    (("fsdp",), ("expert",), GROUPS["tensor"]),  # fsdp x expert x tensor
)


# Mistral (recipes/mistral.py: a sliding window of 16 of 64 keys), on the cells where the
# window changes the kernel's work: context parallelism beside every other strategy but expert.
MISTRAL_PAIRS = (("ulysses", "tensor"), ("allgather", "fsdp"))


# Qwen3-MoE (recipes/qwen3_moe.py: QK-norm and 128-expert-style routing in small) on every pair
# with expert but context (the DeepSeek cells hold expert x context); Gemma 3 (recipes/gemma3.py:
# local and global layers in one model) where the two kinds meet a kernel or a stage: the ring
# beside every strategy but expert (pipelines: a stage holds both kinds), and these.
GEMMA3_PAIRS = (("ulysses", "tensor+sp"), ("allgather", "fsdp"), ("interleaved", "tensor"))


# LoRA (lora.rank=4 on the llama recipe's every projection, the moe recipe's attention beside
# expert; jaxpar.step.lora): the frozen weights and the adapters under a strategy of each axis.
LORA = ("lora.rank=4",)
LORA_CELLS = (("zero3", "tensor+sp"), ("zero1", "fsdp"), ("fsdp", "ring"), ("ulysses", "tensor"), ("1f1b", "fsdp"),
              ("interleaved", "tensor+sp"), ("zb-h1", "data"), ("expert", "tensor"), ("1f1b", "fsdp", "tensor+sp"))


# Variants of a recipe: (recipe, overrides, why). Key/value heads fewer than mesh.tensor, repeated
# at use (jaxpar.step.layout.kv_repeats): the llama recipe with one kv head for its 16 query heads
# ([kv1]) beside a strategy of each axis; Gemma 3 1B's heads (4 query, 1 kv) in the gemma3 recipe
# ([gemma3_1b]) where its local and global layers meet a kernel or a stage.
VARIANTS = {
    "kv1": ("llama", ("model.num_kv_heads=1",), "the cell's subject: 1 key/value head under mesh.tensor=2, repeated at use"),
    "gemma3_1b": ("gemma3", ("model.num_heads=4", "model.num_kv_heads=1"),
                  "the cell's subject: Gemma 3 1B's 4 query heads and 1 key/value head, repeated at use over tensor"),
    "qwen3_moe_dense": ("qwen3_moe", ("model.mlp_only_layers=1,3", "model.dense_mlp=128"),
                        "the cell's subject: Qwen3-MoE's dense layers (mlp_only_layers) among its MoE ones"),
    "uneven": ("llama", ("model.num_layers=5", "parallel.pipeline.balance=balanced"),
               "the cell's subject: 5 layers over the stages, split unevenly by parallel.pipeline.balance=balanced"),
    "deepseek_uneven": ("deepseek", ("parallel.pipeline.layers=1,2",),
                        "the cell's subject: the dense layer alone on the first stage, both MoE ones on the second"),
    "two_batch": ("deepseek", ("parallel.two_batch_overlap=true",),
                  "the cell's subject: each layer on two halves of the rows (one's all-to-alls beside the other's compute)"),
    "fp8_experts": ("deepseek", ("train.matmul_dtype=fp8", "train.fp8_expert_block=16", "parallel.expert_dispatch_dtype=fp8",
                                 "model.bias_update_rate=0"),
                    "the cell's subject: FP8 experts in tiles (16 here, so a contraction spans two) and FP8 dispatch; "
                    "bias balancing off (its sign rule turns one 8-bit rounding into a different routing next step)"),
    "two_hops": ("deepseek", ("model.routing=capacity", "model.group_capacity=true", "mesh.hosts.expert=2"),
                 "the cell's subject: group capacity with the expert axis over 2 hosts, exchanged in two hops"),
    "muon": ("llama", ("optim.name=muon", "optim.lr=0.02"),
             "the cell's subject: Muon (jaxpar.step.muon), each matrix made whole where the layout splits it"),
    "muon_deepseek": ("deepseek", ("optim.name=muon", "optim.lr=0.02"),
                      "the cell's subject: Muon on DeepSeek's latent attention, its experts (a stack of matrices "
                      "per layer) and its dense layers' stack"),
    "qk_clip": ("llama", ("optim.qk_clip=0.45",),
                "the cell's subject: QK-clip (optim.qk_clip), each head's largest logit carried to the update by "
                "its largest value, below the recipe's logits so that every step clips"),
    # At Muon's lr=0.02 AdamW's part moves the head by a share of lr wherever its gradient is
    # near zero: a clip's float32 difference of 1e-7 showed as 1e-5 there (the cells' lr stays 3e-3).
    "qk_clip_deepseek": ("deepseek", ("optim.qk_clip=3", "optim.name=muon"),
                         "the cell's subject: MuonClip on latent attention (DeepSeek's logits start near 4)"),
    "offload_params": ("llama", ("parallel.zero.offload_params=true",),
                       "the cell's subject: the parameters and master resting in host memory, fetched at each use "
                       "(a no-op on the CPU backend, but every array's memory space typed)"),
    "offload_params_deepseek": ("deepseek", ("parallel.zero.offload_params=true",),
                                "the cell's subject: host-resting parameters beside experts"),
    "diloco": ("llama", ("parallel.diloco.inner_steps=2",),
               "the cell's subject: DiLoCo, each data replica a group, synchronised after step 2"),
    "diloco_moe": ("moe", ("parallel.diloco.inner_steps=2",), "the cell's subject: DiLoCo with experts inside each group"),
    "diloco_streaming": ("llama", ("parallel.diloco.inner_steps=4", "parallel.diloco.fragments=2",
                                   "parallel.diloco.delay=1", "parallel.diloco.mix=0.5"),
                         "the cell's subject: streaming DiLoCo, the first fragment after step 2, its exchange beside "
                         "the step, mixed half and half"),
}
# FP8 cells compare with the single-device FP8 run to this tolerance, not RTOL: a gradient on
# an 8-bit (e5m2: 2 mantissa bits) rounding boundary may round the other way when float32 sums
# it in another order, and Adam divides by the gradients' size, so a parameter whose gradient
# is near zero moves by a share of lr (measured: losses within 1.2e-7, parameters 6.5e-4).
VARIANT_RTOL = {"fp8_experts": 1e-3}
# parallel.* settings that change the arithmetic, not only the layout: the reference runs them too.
NUMERICS = ("parallel.expert_dispatch_dtype", "parallel.diloco")
# DiLoCo's groups are its arithmetic: its cells' reference keeps them, each group on one device
# (mesh.data=2 on 2 devices), so the cell checks every layout inside a group against none.
GROUPS_MESH = "mesh.data=2"
KV1_CELLS = (("data", "tensor+sp"), ("zero3", "tensor"), ("fsdp", "tensor+sp"), ("ring", "tensor+sp"), ("ulysses", "tensor"),
             ("allgather", "tensor"), ("1f1b", "tensor"), ("interleaved", "tensor+sp"), ("zb-h1", "tensor"),
             ("1f1b", "fsdp", "tensor+sp"), ("fsdp", "ring", "tensor+sp"))
GEMMA3_1B_CELLS = (("data", "tensor"), ("ring", "tensor+sp"), ("ulysses", "tensor"), ("allgather", "tensor+sp"),
                   ("gpipe", "tensor"))
# Qwen3-MoE with dense layers 1 and 3 among its MoE ones (models/moe.py's layer runs) beside expert;
# a pipeline is refused in one line (a dense layer after an MoE one cannot be cut into stages).
# Stages of different sizes (jaxpar.pipeline.split) under every schedule, the llama recipe's and
# DeepSeek's (its dense layer on the first stage); the two-batch overlap beside expert.
UNEVEN_CELLS = (("gpipe", "fsdp"), ("1f1b", "tensor+sp"), ("interleaved", "tensor"), ("zb-h1", "data"),
                ("1f1b", "fsdp", "tensor+sp"))
DEEPSEEK_UNEVEN_CELLS = (("1f1b", "data", "expert"), ("zb-h1", "expert"), ("gpipe", "expert", "tensor"),
                         ("1f1b-overlap", "data", "expert"))
TWO_BATCH_CELLS = (("data", "expert"), ("1f1b", "data", "expert"), ("fsdp", "expert", "tensor"), ("expert", "tensor+sp"))
# FP8 experts and dispatch where every device sums what it quantizes in the single device's
# order. Where float32 sums run in another order before a quantization (tensor parallelism's
# all-reduce, 1F1B x data), a value on an 8-bit boundary rounds the other way and routing
# carries it on: 1f1b x data x expert and fsdp x expert x tensor drift to 1e-3 by the third
# step, as any 8-bit run differs from another layout's (docs/moe.md "FP8 experts").
FP8_EXPERTS_CELLS = (("data", "expert"), ("fsdp", "expert"), ("gpipe", "expert"))
# Node-limited routing (jaxpar.kernels.experts.two_hop): the expert axis over 2 hosts, a token
# crossing once per group, beside data, under 1F1B stages, and with the experts split over tensor.
TWO_HOPS_CELLS = (("data", "expert"), ("1f1b", "data", "expert"), ("fsdp", "expert", "tensor"))
# Muon (optim.name=muon): matrices in pieces over data (ZeRO), fsdp, tensor, stages and experts.
MUON_CELLS = (("zero1", "tensor+sp"), ("zero3", "tensor"), ("fsdp", "tensor+sp"), ("ring", "tensor"), ("1f1b", "fsdp"),
              ("interleaved", "tensor"), ("zb-h1", "data"), ("1f1b", "fsdp", "tensor+sp"))
MUON_DEEPSEEK_CELLS = (("data", "expert"), ("zero1", "expert"), ("fsdp", "expert"), ("expert", "tensor"),
                       ("1f1b", "data", "expert"))
# QK-clip: the largest logits over data (ZeRO), fsdp, tensor, context and experts; stages are refused.
QK_CLIP_CELLS = (("zero1", "tensor+sp"), ("zero3", "tensor"), ("fsdp", "ring"), ("ulysses", "tensor"), ("1f1b", "data"))
QK_CLIP_DEEPSEEK_CELLS = (("data", "expert"), ("expert", "tensor"))
# Parameters in host memory: beside each axis's strategy; stages are refused.
OFFLOAD_PARAMS_CELLS = (("zero1", "tensor+sp"), ("zero3", "fsdp"), ("fsdp", "ring"), ("ulysses", "tensor"), ("gpipe", "data"))
OFFLOAD_PARAMS_DEEPSEEK_CELLS = (("data", "expert"), ("expert", "tensor"))
# DiLoCo over data (its groups) with each axis's strategy inside a group; ZeRO over data and
# stages are refused.
DILOCO_CELLS = (("data", "fsdp"), ("data", "tensor+sp"), ("data", "ring"), ("data", "fsdp", "tensor"), ("1f1b", "data"),
                ("zero1", "fsdp"))
DILOCO_MOE_CELLS = (("data", "expert"),)
DILOCO_STREAMING_CELLS = (("data", "fsdp"), ("data", "tensor"), ("data", "fsdp", "tensor+sp"))
QWEN3_MOE_DENSE_CELLS = (("data", "expert"), ("zero1", "expert"), ("fsdp", "expert"), ("expert", "tensor"),
                         ("expert", "tensor+sp"), ("1f1b", "expert"), ("fsdp", "expert", "tensor"))


@dataclasses.dataclass(frozen=True)
class Cell:
    strategies: tuple[str, ...]  # in mesh axis order
    family: str = ""  # "" (the llama and moe recipes), a family's recipe ("deepseek", ...), "lora" (LORA on them),
    # or one of VARIANTS (a recipe with overrides)

    @property
    def name(self) -> str:
        return " x ".join(self.strategies) + (f" [{self.family}]" if self.family else "")

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "_", self.name).strip("_")

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(BY_NAME[s].axis for s in self.strategies)

    @property
    def recipe(self) -> str:
        plain = "moe" if "expert" in self.strategies else "llama"
        if self.family in VARIANTS:
            return VARIANTS[self.family][0]
        return plain if self.family in ("", "lora") else self.family

    @property
    def devices(self) -> int:
        return DEGREE ** len(self.strategies)

    @property
    def mesh(self) -> dict[str, int]:
        return {axis: DEGREE if axis in self.axes else 1 for axis in AXES}

    @property
    def adapted(self) -> tuple[tuple[str, str], ...]:
        """(override, why): what the recipe needs changed for this cell to be legal at all."""
        out = []
        if "stage" in self.axes:
            out.append(("train.microbatches=2",
                        "pipeline-microbatches-per-stage / interleaved-microbatch-groups: a pipeline of mesh.stage=2 "
                        "runs at least (for interleaved, a multiple of) 2 microbatches; gpipe is given the same"))
        if self.recipe == "moe" and "context" in self.axes:
            out.append(("model.routing=dropless",
                        "model-contract: the moe recipe's capacity routing needs whole sequences (mesh.context=1)"))
        if self.family == "lora":
            out += [(o, "the cell's subject: LoRA adapters, the rest frozen") for o in LORA]
        if self.family in VARIANTS:
            _, sets, why = VARIANTS[self.family]
            out += [(o, why) for o in sets]
        return tuple(out)

    @property
    def overrides(self) -> list[str]:
        """Every --set of the cell's run (but checkpoint.dir)."""
        sets = [f"mesh.{axis}={size}" for axis, size in self.mesh.items()]
        sets.append("parallel.tensor.sequence_parallel=false")
        for s in self.strategies:
            sets += [o for o in BY_NAME[s].sets if o not in sets]
        sets = [o for o in sets if not (o == "parallel.tensor.sequence_parallel=false" and "tensor+sp" in self.strategies)]
        return sets + list(BASE) + [o for o, _ in self.adapted]

    @property
    def reference_key(self) -> tuple[str, tuple[str, ...]]:
        """The reference's recipe and overrides: the adapted ones but layouts' (parallel.*,
        mesh.*), which a single device runs without (a variant's pipeline split, its two-batch
        overlap, its hosts), bar those that change the arithmetic (NUMERICS)."""
        layout = lambda o: o.startswith(("parallel.", "mesh.")) and not o.startswith(NUMERICS)  # noqa: E731
        kept = tuple(o for o, _ in self.adapted if not layout(o))
        return self.recipe, kept + ((GROUPS_MESH,) if any(o.startswith("parallel.diloco") for o in kept) else ())


def cells() -> list[Cell]:
    """Every pair of strategies on different axes, then the TRIPLES; each in axis order."""
    order = {s.name: (AXES.index(s.axis), i) for i, s in enumerate(STRATEGIES)}
    out = [Cell(tuple(sorted(pair, key=order.get))) for pair in itertools.combinations(BY_NAME, 2)
           if BY_NAME[pair[0]].axis != BY_NAME[pair[1]].axis]
    out.sort(key=lambda c: [order[s] for s in c.strategies])
    for groups in TRIPLES:
        out += [Cell(tuple(sorted(combo, key=order.get))) for combo in itertools.product(*groups)]
    out += [Cell(c.strategies, "deepseek") for c in out if "expert" in c.strategies and len(c.strategies) == 2]
    for groups in DEEPSEEK_TRIPLES:
        out += [Cell(tuple(sorted(combo, key=order.get)), "deepseek") for combo in itertools.product(*groups)]
    plain = [c for c in out if not c.family and len(c.strategies) == 2]
    out += [Cell(c.strategies, "mistral") for c in plain if "ring" in c.strategies and "expert" not in c.strategies]
    out += [Cell(tuple(sorted(pair, key=order.get)), "mistral") for pair in MISTRAL_PAIRS]
    out += [Cell(c.strategies, "qwen3") for c in plain if "tensor+sp" in c.strategies and "expert" not in c.strategies]
    out += [Cell(c.strategies, "qwen3_moe") for c in plain if "expert" in c.strategies and "context" not in c.axes]
    out += [Cell(c.strategies, "gemma3") for c in plain if "ring" in c.strategies and "expert" not in c.strategies]
    out += [Cell(tuple(sorted(pair, key=order.get)), "gemma3") for pair in GEMMA3_PAIRS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "lora") for combo in LORA_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "kv1") for combo in KV1_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "gemma3_1b") for combo in GEMMA3_1B_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "qwen3_moe_dense") for combo in QWEN3_MOE_DENSE_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "uneven") for combo in UNEVEN_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "deepseek_uneven") for combo in DEEPSEEK_UNEVEN_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "two_batch") for combo in TWO_BATCH_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "fp8_experts") for combo in FP8_EXPERTS_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "two_hops") for combo in TWO_HOPS_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "muon") for combo in MUON_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "muon_deepseek") for combo in MUON_DEEPSEEK_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "qk_clip") for combo in QK_CLIP_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "qk_clip_deepseek") for combo in QK_CLIP_DEEPSEEK_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "offload_params") for combo in OFFLOAD_PARAMS_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "offload_params_deepseek")
            for combo in OFFLOAD_PARAMS_DEEPSEEK_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "diloco") for combo in DILOCO_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "diloco_moe") for combo in DILOCO_MOE_CELLS]
    out += [Cell(tuple(sorted(combo, key=order.get)), "diloco_streaming") for combo in DILOCO_STREAMING_CELLS]
    return out


# ---------------------------------------------------------------------------- running


def jaxpar_command() -> list[str]:
    script = pathlib.Path(sys.executable).parent / "jaxpar"
    if script.exists():
        return [str(script)]
    found = shutil.which("jaxpar")
    return [found] if found else [sys.executable, "-c", "import sys; from jaxpar.commands import main; sys.exit(main())"]


def train_argv(recipe: str, devices: int, overrides: list[str]) -> list[str]:
    argv = [*jaxpar_command(), "train", recipe, "--cpu-devices", str(devices)]
    for o in overrides:
        argv += ["--set", o]
    return argv + ["--no-progress"]


def repro(argv: list[str]) -> str:
    """The command as one would type it from the checkout."""
    first = argv[0]
    try:
        first = str(pathlib.Path(first).relative_to(ROOT))
    except ValueError:
        pass
    return shlex.join([first, *argv[1:]])


def no_core_dumps() -> None:
    """An XLA abort in a cell should not leave a core file (set here, inherited by the runs:
    a preexec_fn would run Python between fork and exec in a threaded process)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


def run_cli(argv: list[str], workdir: pathlib.Path, timeout_s: float, params: bool) -> dict:
    """Run `jaxpar train` once; returns rc, stderr, the metrics and the checkpoint's path."""
    metrics = workdir / "metrics.jsonl"
    ckpt = workdir / "ckpt"
    full = [*argv, "--metrics-file", str(metrics)] + (["--set", f"checkpoint.dir={ckpt}"] if params else [])
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    losses = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                losses.append(float(json.loads(line)["loss"]))
            except (ValueError, KeyError):
                pass
    state = ckpt / str(STEPS) / "state"
    return {"rc": proc.returncode, "timed_out": timed_out, "stdout": out, "stderr": err, "losses": losses,
            "state": state if state.is_dir() else None, "seconds": round(time.perf_counter() - t0, 1)}


_XLA_LOG = re.compile(r"^[WI]\d{4} ")  # XLA's warning and info lines (F and E lines stay)


def stderr_tail(stderr: str, chars: int = 1500) -> str:
    lines = [l for l in stderr.splitlines() if not _XLA_LOG.match(l) and not l.startswith("WARNING:absl")]
    return "\n".join(lines)[-chars:]


def failure_reason(result: dict, timeout_s: float) -> str:
    err = result["stderr"]
    if result["timed_out"]:
        return f"timed out after {timeout_s:.0f} s"
    rc = result["rc"]
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else f"signal {-rc}"
        from jaxpar.logs import last_words

        said = last_words(err)  # XLA's fatal line, when it printed one
        return f"killed by {name}: {said}" if said else f"killed by {name}"
    lines = [l.strip() for l in err.splitlines() if l.strip() and not _XLA_LOG.match(l)]
    stopped = [l for l in lines if l.startswith("jaxpar: ")]
    if stopped:
        return f"exit {rc}: {stopped[-1][:300]}"
    raised = [l for l in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", l)]
    if raised:
        return f"exit {rc}: {raised[-1][:300]}"
    return f"exit {rc}: {lines[-1][:300] if lines else 'no output on stderr'}"


def load_params(state: pathlib.Path) -> dict:
    """{key path: array} of the checkpoint's parameters, on the host."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(state).item_metadata.tree
    restored = checkpointer.restore(state, restore_args=jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(restored["params"])}


def compare(result: dict, reference: dict, rtol: float, reach: float = 0.0) -> tuple[bool, str, dict]:
    """(equal, detail, numbers). `reach`: the most an Adam step moves an element (lr) x the
    steps, the scale an array smaller than it is measured against: one that started at zero
    (Gemma's (1 + w) norms) is still about that small, and Adam's step, the gradient over its
    own running size, turns fp32 noise in an element's tiny gradient into a share of lr that
    its magnitude would magnify (the gradients themselves agree to ~1e-6)."""
    import numpy as np

    got, want = result["losses"], reference["losses"]
    if len(got) != len(want):
        return False, f"mismatch: {len(got)} losses in the metrics file, the reference has {len(want)}", {}
    rel = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, want)]
    numbers = {"max_loss_rel": max(rel)}
    if not all(np.isfinite(got)) or max(rel) > rtol:
        step = int(np.argmax(rel))
        return False, (f"mismatch: loss at step {step} is {got[step]:.7g}, the reference's {want[step]:.7g} "
                       f"(relative {rel[step]:.1e} > {rtol:g})"), numbers
    if reference.get("params") is None:
        return True, f"losses within {max(rel):.1e} (parameters not compared)", numbers
    if result["state"] is None:
        return False, "no checkpoint written at the last step: parameters cannot be compared", numbers
    params, ref = load_params(result["state"]), reference["params"]
    if params.keys() != ref.keys() or any(params[k].shape != ref[k].shape for k in ref):
        return False, "mismatch: the final parameters' tree or shapes differ from the reference's", numbers
    worst, where = 0.0, ""
    for k, want_k in ref.items():
        scale = max(float(np.abs(want_k).max()), reach, 1e-30)
        err = float(np.abs(params[k] - want_k).max()) / scale if want_k.size else 0.0
        if not np.isfinite(err) or err > worst:
            worst, where = (float("inf") if not np.isfinite(err) else err), k
    numbers["max_param_rel"] = worst
    if worst > rtol:
        return False, f"mismatch: parameter {where} differs by {worst:.1e} of its scale (> {rtol:g})", numbers
    return True, f"losses within {max(rel):.1e}, parameters within {worst:.1e}", numbers


def adam_reach(recipe: str) -> float:
    """How far STEPS Adam steps can move a parameter: the recipe's peak learning rate each."""
    sys.path.insert(0, str(ROOT))
    from jaxpar import recipes

    return recipes.load(recipe).optim.lr * STEPS


def run_reference(key, workroot: pathlib.Path, timeout_s: float, params: bool) -> dict:
    recipe, adapted = key
    argv = train_argv(recipe, 2 if GROUPS_MESH in adapted else 1, [*BASE, *adapted])
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="ref_", dir=workroot))
    result = run_cli(argv, workdir, timeout_s, params)
    ok = result["rc"] == 0 and len(result["losses"]) == STEPS and (result["state"] is not None or not params)
    record = {"recipe": recipe, "adapted": list(adapted), "command": repro(argv), "ok": ok, "losses": result["losses"],
              "seconds": result["seconds"], "params": load_params(result["state"]) if ok and params else None}
    if not ok:
        record["reason"] = failure_reason(result, timeout_s) if result["rc"] else "finished without every step's loss"
        record["stderr_tail"] = stderr_tail(result["stderr"])
    shutil.rmtree(workdir, ignore_errors=True)
    return record


def run_cell(cell: Cell, reference: dict, workroot: pathlib.Path, timeout_s: float, params: bool, rtol: float) -> dict:
    argv = train_argv(cell.recipe, cell.devices, cell.overrides)
    record = {"cell": cell.name, "strategies": list(cell.strategies), "axes": list(cell.axes), "recipe": cell.recipe,
              "devices": cell.devices, "mesh": {k: v for k, v in cell.mesh.items() if v > 1},
              "overrides": cell.overrides, "adapted": [{"set": o, "why": why} for o, why in cell.adapted],
              "command": repro(argv)}
    workdir = pathlib.Path(tempfile.mkdtemp(prefix=cell.slug + "_", dir=workroot))
    try:
        result = run_cli(argv, workdir, timeout_s, params)
        record.update(seconds=result["seconds"], rc=result["rc"], losses=result["losses"])
        err_lines = [l for l in result["stderr"].splitlines() if l.strip()]
        if result["rc"] == 2 and not result["timed_out"] and err_lines and err_lines[-1].startswith("jaxpar: error: "):
            record.update(status="refused", detail=err_lines[-1].removeprefix("jaxpar: error: "))
        elif result["rc"] != 0 or result["timed_out"]:
            record.update(status="failed", detail=failure_reason(result, timeout_s),
                          stderr_tail=stderr_tail(result["stderr"]))
        elif not reference["ok"]:
            record.update(status="failed", detail=f"the single-device reference failed: {reference.get('reason')}")
        else:
            equal, detail, numbers = compare(result, reference, max(rtol, VARIANT_RTOL.get(cell.family, 0.0)),
                                             reach=adam_reach(cell.recipe))
            record.update(status="equal" if equal else "failed", detail=detail, reference_losses=reference["losses"],
                          **numbers)
            if not equal:
                record["stderr_tail"] = stderr_tail(result["stderr"])
    except Exception as e:  # the matrix's own trouble (reading a checkpoint, ...): the cell fails, the run goes on
        record.update(status="failed", detail=f"matrix: {type(e).__name__}: {e}"[:300])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return record


def print_table(records: list[dict], file=sys.stdout) -> dict:
    width = max([len(r["cell"]) for r in records] + [4])
    print(f"{'cell':<{width}}  {'status':<7}  detail", file=file)
    for r in records:
        detail = r["detail"] if len(r["detail"]) <= 140 else r["detail"][:137] + "..."
        print(f"{r['cell']:<{width}}  {r['status']:<7}  {detail}", file=file)
    counts = {s: sum(r["status"] == s for r in records) for s in ("equal", "refused", "failed")}
    print(f"\n{len(records)} cells: " + ", ".join(f"{n} {s}" for s, n in counts.items()), file=file)
    return counts


def markdown(payload: dict) -> str:
    """The results file as the table of docs/matrix.md."""
    meta, counts = payload["meta"], payload["counts"]
    lines = [f"{counts['cells']} cells: {counts['equal']} equal, {counts['refused']} refused, {counts['failed']} failed "
             f"(jax {meta['jax']}, {meta['date'][:10]}, {meta['minutes']} min with --jobs {meta['jobs']} on "
             f"{meta['cpus']} cores).", "", "| cell | recipe | devices | status | detail |", "|---|---|---|---|---|"]
    for r in payload["cells"]:
        detail = r["detail"].replace("|", "\\|")
        adapted = "".join(f" (+{a['set']})" for a in r["adapted"])
        lines.append(f"| {r['cell']} | {r['recipe']}{adapted} | {r['devices']} | {r['status']} | {detail} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", action="append", default=[], metavar="SUBSTRING",
                   help="run the cells whose name contains SUBSTRING (repeatable: any of them)")
    p.add_argument("--list", action="store_true", help="list the cells (and their overrides) without running them")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="cells run at once (default 1)")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="S", help=f"seconds per run (default {TIMEOUT_S})")
    p.add_argument("--rtol", type=float, default=RTOL, help=f"relative tolerance (default {RTOL:g})")
    p.add_argument("--no-params", action="store_true", help="compare losses only (no checkpoint written)")
    p.add_argument("--markdown", metavar="RESULTS", help="print a results file as a markdown table and exit")
    p.add_argument("--out", default=None, metavar="PATH",
                   help=f"JSON results (default {DEFAULT_OUT.relative_to(ROOT)}; with --only, none unless given)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(pathlib.Path(args.markdown).read_text())))
        return 0
    selected = [c for c in cells() if not args.only or any(s in c.name for s in args.only)]
    if args.list:
        for c in selected:
            adapted = "  (adapted: " + ", ".join(o for o, _ in c.adapted) + ")" if c.adapted else ""
            shown = [o for o in c.overrides if o not in BASE and not re.fullmatch(r"mesh\.\w+=1", o)]
            print(f"{c.name:<36} {c.recipe:<5} {c.devices} devices  {' '.join(shown)}{adapted}")
        print(f"{len(selected)} cells")
        return 0
    if not selected:
        print(f"no cell matches {args.only}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    no_core_dumps()
    params = not args.no_params
    keys = sorted({c.reference_key for c in selected})
    workroot = pathlib.Path(tempfile.mkdtemp(prefix="jaxpar-matrix-"))
    started = time.time()
    records: dict[str, dict] = {}
    try:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool, \
                tqdm(total=len(keys) + len(selected), unit="run", dynamic_ncols=True) as bar:
            bar.set_description("references")
            futures = {pool.submit(run_reference, k, workroot, args.timeout, params): k for k in keys}
            references = {}
            for f in as_completed(futures):
                references[futures[f]] = f.result()
                bar.update()
            bar.set_description("cells")
            futures = {pool.submit(run_cell, c, references[c.reference_key], workroot, args.timeout, params,
                                   args.rtol): c for c in selected}
            for f in as_completed(futures):
                r = f.result()
                records[r["cell"]] = r
                bar.set_postfix_str(f"{r['cell']}: {r['status']}")
                bar.update()
    finally:
        shutil.rmtree(workroot, ignore_errors=True)
    ordered = [records[c.name] for c in selected]
    print()
    counts = print_table(ordered)
    out = args.out if args.out is not None else (None if args.only else str(DEFAULT_OUT))
    if out:
        import jax

        payload = {
            "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
                     "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                     "platform": os.environ.get("JAX_PLATFORMS", "cpu"), "degree": DEGREE, "steps": STEPS,
                     "rtol": args.rtol, "timeout_s": args.timeout, "params_compared": params, "jobs": args.jobs,
                     "only": args.only, "minutes": round((time.time() - started) / 60, 1)},
            "counts": {"cells": len(ordered), **counts},
            "references": [{k: v for k, v in references[k].items() if k != "params"} for k in keys],
            "cells": ordered,
        }
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {path}")
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
