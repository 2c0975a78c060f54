"""The choice fields' allowed values, each defined once as a `Literal` type.

jaxpar.config annotates its fields with these; `--set` parses a choice to its Literal's type
and refuses any other value (jaxpar.config.apply_overrides), the catalogue's `choice-values`
rule checks every choice field of a config built any other way (jaxpar.checks.choices), and
docs/config_checks.md lists them. The kernels, pipeline and sharding modules read their
values here (`typing.get_args`) rather than keep a tuple of their own. This module sits at
the bottom of the package: it imports nothing of jaxpar but its errors.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from jaxpar.errors import ConfigError

# parallel
CollectiveMatmul = Literal["none", "ring", "bidirectional"]
ZeroStage = Literal[0, 1, 2, 3]
GradientCompression = Literal["none", "int8", "powersgd", "topk"]
ContextImpl = Literal["ring", "ulysses", "allgather"]
SequenceLayout = Literal["zigzag", "contiguous"]
AttentionKernel = Literal["jax", "pallas", "pallas_interpret"]
Attention = Literal["auto", "reference", "flash", "cudnn"]  # auto: resolved per device (jaxpar.step.layout)
# auto: resolved per platform (jaxpar.step.layout); the kernel's own set,
# jaxpar.kernels.experts.EXCHANGES, has the resolved ones and an emulated one for tests
ExpertExchange = Literal["auto", "padded", "ragged"]
DispatchDtype = Literal["compute", "fp8"]  # what the experts' dispatch all-to-all moves
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "1f1b-overlap"]
PipelineBalance = Literal["even", "balanced"]  # layers per stage without a list (jaxpar.pipeline.split)
OnReplicated = Literal["warn", "error", "allow"]
OuterCompression = Literal["none", "int8", "topk"]  # what DiLoCo's outer exchange moves (jaxpar.step.diloco)
# train
ComputeDtype = Literal["float32", "bfloat16"]
MatmulDtype = Literal["compute", "fp8"]
LoraBaseDtype = Literal["compute", "fp8"]  # how LoRA's adapted weights rest (jaxpar.step.lora)
OnNonfinite = Literal["stop", "skip"]
# optim (the update rules of jaxpar.step.optim)
Optimizer = Literal["adam", "adamw", "lion", "sgd", "muon"]
MuonScale = Literal["rms", "shape"]  # how Muon scales an orthogonalised update by its shape (jaxpar.step.muon)
# data
DataSource = Literal["synthetic", "tokens", "text", "chat", "preference", "mix"]
DataOrder = Literal["windows", "epochs"]
# compiler
CompilerPreset = Literal["auto", "overlap", "none"]  # auto: overlap on GPUs, none elsewhere
# model (the shipped configs type their fields with these): the remat policies of jaxpar.nn,
# the MoE routers of jaxpar.kernels.experts, the gated MLP's activation by its Hugging Face
# `hidden_act` name (models/llama.py)
Remat = Literal["none", "full", "selective", "offload", "dots", "dots_no_batch"]
Routing = Literal["capacity", "dropless"]
RouterScores = Literal["softmax", "sigmoid"]
Activation = Literal["silu", "gelu_pytorch_tanh"]

RULE = "choice-values"  # the catalogue rule that checks every choice field (jaxpar.checks.choices)


def choice_fields(node: Any, prefix: str = "") -> dict[str, tuple]:
    """{'parallel.zero.stage': (0, 1, 2, 3), ...}: every Literal-typed field under `node`, a
    dataclass or an instance of one, by dotted key. An instance is walked as it is, so its
    model's own choice fields count; a class as its annotations say."""
    cls = node if isinstance(node, type) else type(node)
    hints = typing.get_type_hints(cls)
    found: dict[str, tuple] = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        inner = hint if node is cls else getattr(node, field.name)
        if dataclasses.is_dataclass(inner):
            found.update(choice_fields(inner, f"{prefix}{field.name}."))
        elif typing.get_origin(hint) is Literal:
            found[prefix + field.name] = typing.get_args(hint)
    return found


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    """Refuse `value` for the choice field `key` unless it is one of `allowed`, of the same
    type (True is not the stage 1). The error is the catalogue rule's, wherever it is raised."""
    if not any(type(value) is type(a) and value == a for a in allowed):
        error = ConfigError(f"{key}={value!r}; use one of {', '.join(map(str, allowed))}")
        error.rule = RULE
        raise error
