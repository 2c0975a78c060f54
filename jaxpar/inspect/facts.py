"""What every row of `jaxpar explain` reads, gathered once from the trainer and the compiled
step's report (`facts_of`), and the row they make: a measured figure beside its formula.

The row providers (jaxpar.inspect.rows) read a `Facts`, never the trainer: a provider is a
function of these plain values and the strategy specs the trainer was built with.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.config import Config
from jaxpar.inspect.hlo import Collective
from jaxpar.inspect.report import StepReport
from jaxpar.kernels.quantized import entries
from jaxpar.model import has
from jaxpar.sharding import Layout
from jaxpar.step.compression import Compressor
from jaxpar.step.muon import SCOPE as MUON_SCOPE
from jaxpar.step.muon import find_matrices

_HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s8": "int8", "u8": "uint8",
               "s32": "int32", "u32": "uint32", "f64": "float64", "pred": "bool", "s16": "int16"}

NO_FORMULA = ("no formula: it reads a decoder's embed, vocab_size and tie_embeddings, which the model config "
              "does not have (measured only)")


@dataclasses.dataclass(frozen=True)
class ParamArray:
    """One trained parameter array: its path, size, logical names and the mesh axes its
    resting sharding splits it over."""

    path: str
    size: int
    names: tuple[str, ...]
    axes: tuple[str, ...]
    shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Facts:
    """The step explain accounts for. Parameter counts are in elements: Ψ is the trained
    parameters; Ψ_E the expert weights; Ψ_L the layer stack (under stages only, else 0);
    these are the model's own counts. Ψ_s is what one pipeline stage holds but experts
    (Ψ - Ψ_E without stages), Ψ_Es its expert weights before the split over expert: these
    are as stored, with the rows that pad stages of fewer layers (jaxpar.pipeline.split)."""

    config: Config
    report: StepReport
    layout: Layout
    pipeline: Any  # jaxpar.pipeline.program.Program, when mesh.stage > 1
    compressor: Compressor | None
    params: tuple[ParamArray, ...]
    psi: int
    psi_frozen: int  # LoRA's frozen weights (elements)
    frozen_bytes: float | None  # the bytes of them one stage holds, as stored; None without a frozen tree
    psi_experts: int
    psi_layers: int
    psi_stage: float
    psi_experts_stage: float
    moments: float  # optimizer state elements per parameter
    compute_bytes: int  # train.compute_dtype's itemsize
    matrices: Any = None  # Muon's (jaxpar.step.muon.find_matrices), None under another optimizer

    @property
    def mesh(self) -> dict[str, int]:
        return self.report.mesh

    @property
    def step_collectives(self) -> list[Collective]:
        """The compiled step's collectives but the optimizer's own (Muon's orthogonalisation,
        which has rows of its own: jaxpar.inspect.optimizer)."""
        return [c for c in self.report.collectives if MUON_SCOPE not in c.op_name]

    @property
    def optimizer_collectives(self) -> list[Collective]:
        return [c for c in self.report.collectives if MUON_SCOPE in c.op_name]

    @property
    def zero_stage(self) -> int:
        return self.layout.zero.stage

    @property
    def stages(self) -> int:
        return self.mesh.get("stage", 1)

    @property
    def frozen(self) -> bool:
        """Whether the step has frozen weights (LoRA's base)."""
        return self.frozen_bytes is not None

    @property
    def stage_split(self) -> Any:
        """The pipeline's jaxpar.pipeline.split.StageSplit where stages differ in size, else None."""
        return self.pipeline.layers if self.pipeline is not None else None

    def params_named(self, name: str) -> int:
        """Parameters whose logical names include `name`."""
        return sum(p.size for p in self.params if name in p.names)


def facts_of(trainer, report: StepReport) -> Facts:
    """The facts of `trainer`'s step as `report` measured it."""
    state = trainer.abstract_state()
    groups = trainer.mesh.shape["data"] if state.outer is not None else 1  # DiLoCo: each group's copy stacked
    params = _param_arrays(trainer, state.params if groups == 1 else state.outer.anchor,
                           trainer.state_shardings.params if groups == 1 else trainer.shardings.params)
    p = report.mesh.get("stage", 1)
    split = trainer.stage_split if p > 1 else None
    # A stacked array rests as rows (padded where stages differ): a stage holds 1/stage of
    # them, the model has split.layers of them. Expert weights live in the stack too.
    unpad = split.layers / split.rows if split is not None else 1.0
    stacked = lambda a: p > 1 and "layers" in a.names
    real = lambda a: a.size * unpad if stacked(a) else a.size
    held = lambda a: a.size / p if stacked(a) else a.size
    experts = [a for a in params if "experts" in a.names]
    psi_frozen, frozen_bytes = _frozen(state.frozen, p, unpad)
    return Facts(
        config=trainer.config, report=report, layout=trainer.layout, pipeline=trainer.pipeline,
        compressor=trainer.compressor, params=params, psi=round(sum(map(real, params))),
        psi_frozen=psi_frozen, frozen_bytes=frozen_bytes,
        psi_experts=round(sum(map(real, experts))), psi_layers=round(sum(real(a) for a in params if stacked(a))),
        psi_stage=sum(held(a) for a in params if "experts" not in a.names),
        psi_experts_stage=sum(map(held, experts)),
        moments=sum(math.prod(x.shape) for x in jax.tree.leaves(state.opt_state) if x.ndim) / groups
        / sum(a.size for a in params),
        compute_bytes=jnp.dtype(trainer.config.train.compute_dtype).itemsize,
        matrices=find_matrices(trainer.config.model, trainer.param_names, trainer.shardings.optimizer,
                               ("data",) if trainer.layout.diloco.inner_steps else ())
        if trainer.config.optim.name == "muon" else None,
    )


def _frozen(frozen, p: int, unpad: float) -> tuple[int, float | None]:
    """LoRA's frozen weights: (the model's count, the bytes one stage holds as stored; None
    without them). Under stages those under "layers" are stacked, as the parameters."""
    if frozen is None:
        return 0, None
    stacked = frozen.get("layers") if p > 1 else None
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    nbytes = lambda tree: sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))
    if stacked is None:
        return count(frozen), nbytes(frozen)
    return (round(count(frozen) - count(stacked) * (1 - unpad)),
            nbytes(frozen) - nbytes(stacked) * (1 - 1 / p))


def _param_arrays(trainer, params, shardings) -> tuple[ParamArray, ...]:
    names = jax.tree.leaves(trainer.param_names, is_leaf=lambda x: hasattr(x, "names"))
    shardings = jax.tree.leaves(shardings)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return tuple(
        ParamArray(path=jax.tree_util.keystr(path, simple=True, separator="."), size=math.prod(x.shape), shape=x.shape,
                   names=tuple(n.names), axes=tuple(a for entry in entries(sharding.spec, x.ndim) for a in entry))
        for (path, x), n, sharding in zip(leaves, names, shardings, strict=True)
    )


def itemsize(c: Collective) -> int:
    """Bytes of one element a collective sends, by its HLO dtype (float32 when unknown)."""
    return jnp.dtype(_HLO_DTYPES.get(c.dtype, "float32")).itemsize


def elements(c: Collective) -> float:
    """Elements a collective moves per device per step."""
    return c.bytes_per_step / itemsize(c)


def decoder_fields(model) -> bool:
    """Whether the pipeline traffic formulas can read the model (our decoders' fields)."""
    return all(has(model, f) for f in ("embed", "vocab_size", "tie_embeddings"))


def row(name: str, measured: float, formula: float | None) -> dict[str, Any]:
    """A measured figure beside its formula (None: no formula) and their ratio."""
    ratio = measured / formula if formula else None
    return {"name": name, "measured": measured, "formula": formula, "ratio": ratio}


def table_header(title: str) -> str:
    return f"{title:<52}{'measured':>12}{'formula':>12}{'ratio':>8}"


def line(row: dict[str, Any], fmt) -> str:
    """A row as the table prints it, its figures by `fmt` (jaxpar.units' byte_size or count)."""
    formula = fmt(row["formula"]) if row["formula"] is not None else ""
    ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else ""
    return f"  {row['name']:<50}{fmt(row['measured']):>12}{formula:>12}{ratio:>8}"
