"""The optim section: the optimizer's numbers."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError
from jaxpar.kernels.newton_schulz import parse_coeffs
from jaxpar.model import declared
from jaxpar.pipeline.split import leading_layers

RULES: list[Rule] = []
rule = collector(RULES)


# optim field -> (what holds, as a test of the value; what to say)
OPTIM_RANGES = {
    "lr": (lambda x: 0 < x < float("inf"), "a positive learning rate, e.g. 3e-4"),
    "warmup_steps": (lambda x: x >= 0, ">= 0 (0: no warm-up)"),
    "decay_steps": (lambda x: x >= 0, ">= 0 (0: decay over train.steps)"),
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "between 0 and 1 (the final learning rate over the peak)"),
    "b1": (lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.9"),
    "b2": (lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.95"),
    "eps": (lambda x: 0 < x < float("inf"), "> 0, e.g. 1e-8"),
    "weight_decay": (lambda x: x >= 0, ">= 0 (0: none)"),
    "clip_norm": (lambda x: x >= 0, ">= 0 (0: no clipping)"),
}


@rule(
    "optimizer-values",
    fields=[f"optim.{f}" for f in OPTIM_RANGES],
    summary="The optimizer's numbers make sense: a positive learning rate, non-negative steps, decay and clipping, "
    "betas in [0, 1), a positive eps, a final learning-rate ratio in [0, 1].",
    example=["optim.lr=-1"],
    also=[["optim.lr=0"], ["optim.b2=1"], ["optim.warmup_steps=-5"], ["optim.min_lr_ratio=2"]],
)
def optimizer_values(config, sizes) -> None:
    for field, (holds, what) in OPTIM_RANGES.items():
        value = getattr(config.optim, field)
        if not holds(value):
            raise ConfigError(f"optim.{field}={value} makes no sense; use {what}")


def _coeffs_ok(text: str) -> bool:
    try:
        parse_coeffs(text)  # as the optimizer reads them
    except ValueError:
        return False
    return True


# Muon's fields (jaxpar.step.muon): field -> (what holds; what to say)
MUON_RANGES = {
    "momentum": (lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.95"),
    "ns_steps": (lambda x: x >= 1, ">= 1 Newton-Schulz iterations, e.g. 5"),
    "ns_coeffs": (_coeffs_ok, 'three numbers "a,b,c", e.g. "3.4445,-4.7750,2.0315" (Keller Jordan\'s)'),
    "muon_rms": (lambda x: 0 < x < float("inf"), "> 0, e.g. 0.2 (Moonlight's: the update's RMS near AdamW's)"),
}


@rule(
    "muon-values",
    fields=[f"optim.{f}" for f in MUON_RANGES],
    summary="Muon's momentum is in [0, 1), its Newton-Schulz iterations at least 1 with three coefficients "
    '"a,b,c", and its RMS scale positive.',
    example=["optim.name=muon", "optim.ns_coeffs=3.4,-4.7"],
    also=[["optim.name=muon", "optim.momentum=1"], ["optim.name=muon", "optim.ns_steps=0"],
          ["optim.name=muon", "optim.muon_rms=0"]],
)
def muon_values(config, sizes) -> None:
    if config.optim.name != "muon":
        return
    for field, (holds, what) in MUON_RANGES.items():
        value = getattr(config.optim, field)
        if not holds(value):
            raise ConfigError(f"optim.{field}={value!r} makes no sense for Muon; use {what}")


@rule(
    "muon-without-lora",
    fields=["optim.name", "lora.rank"],
    summary="Muon orthogonalises the model's weight matrices; LoRA trains low-rank adapters beside frozen ones, "
    "which Muon does not update (use AdamW for LoRA).",
    example=["optim.name=muon", "lora.rank=4"],
)
def muon_without_lora(config, sizes) -> None:
    if config.optim.name == "muon" and config.lora.rank:
        raise ConfigError(f"optim.name=muon with lora.rank={config.lora.rank}: Muon updates whole weight matrices, "
                          "LoRA's adapters are not; use optim.name=adamw for LoRA, or lora.rank=0")


@rule(
    "qk-clip-supported",
    fields=["optim.qk_clip", "model", "mesh.stage", "parallel.two_batch_overlap", "train.loss_chunks",
            "parallel.compression.method", "lora.rank"],
    summary="QK-clip (optim.qk_clip > 0) needs a model that scales its query and key weights (its clip_qk: Llama, "
    "Mistral, Mixtral, DeepSeek; not q/k norms), and a step that carries the attention's largest logits to the "
    "update: no two-batch overlap, chunked loss, gradient compression or LoRA yet, and under pipeline stages no "
    "layers run outside the stack (DeepSeek's leading dense layers).",
    example=["optim.qk_clip=-1"],
    also=[["optim.qk_clip=100", "model.qk_norm=true"], ["optim.qk_clip=100", "train.loss_chunks=2"],
          ["optim.qk_clip=100", "lora.rank=4"]],
)
def qk_clip_supported(config, sizes) -> None:
    threshold = config.optim.qk_clip
    if threshold < 0:
        raise ConfigError(f"optim.qk_clip={threshold} makes no sense; use a positive logit threshold (Kimi K2: 100), "
                          "or 0 for none")
    if not threshold:
        return
    if declared(config.model, "clip_qk") is None:
        raise ConfigError(f"optim.qk_clip={threshold}: {type(config.model).__name__} does not scale its query and key "
                          "weights for QK-clip (its clip_qk; q/k norms bound the logits already); set optim.qk_clip=0")
    if sizes.get("stage", 1) > 1 and leading_layers(config.model):
        raise ConfigError(f"optim.qk_clip={threshold} with mesh.stage={sizes['stage']}: {type(config.model).__name__}'s "
                          f"{leading_layers(config.model)} leading layers run outside the stack, with the embedding, "
                          "and report no logits there; set optim.qk_clip=0, or mesh.stage=1")
    unsupported = {"parallel.two_batch_overlap": config.parallel.two_batch_overlap,
                   "train.loss_chunks": config.train.loss_chunks > 1,
                   "parallel.compression.method": config.parallel.compression.method != "none",
                   "lora.rank": config.lora.rank > 0}
    for field, on in unsupported.items():
        if on:
            raise ConfigError(f"optim.qk_clip={threshold} with {field} set: that step does not carry the attention's "
                              f"largest logits to the update yet; set optim.qk_clip=0, or leave {field} at its default")
