"""Optimizer from config: a named optax update rule (or Muon, jaxpar.step.muon), warmup +
cosine schedule, and global-norm clipping (which the trainer applies in its own pass:
jaxpar.step.update). Any optax GradientTransformation can be passed to the trainer instead."""

from __future__ import annotations

import optax

from jaxpar.step.muon import Matrices, muon


def _muon(lr: optax.Schedule, optim, matrices: Matrices | None) -> optax.GradientTransformation:
    if matrices is None:
        raise ValueError("optim.name='muon' needs the model's matrices (jaxpar.step.muon.find_matrices)")
    return muon(lr, optim, matrices)


OPTIMIZERS = {  # one per jaxpar.choices.Optimizer (optim.name): (schedule, optim, Muon's matrices) -> rule
    "adamw": lambda lr, c, _: optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay),
    "adam": lambda lr, c, _: optax.adam(lr, b1=c.b1, b2=c.b2, eps=c.eps),
    "lion": lambda lr, c, _: optax.lion(lr, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay),
    "sgd": lambda lr, c, _: optax.sgd(lr, momentum=c.b1 or None),
    "muon": _muon,
}


def schedule(optim, steps: int) -> optax.Schedule:
    """Linear warmup to optim.lr, then cosine decay to optim.lr * optim.min_lr_ratio."""
    decay = optim.decay_steps or steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=optim.lr,
        warmup_steps=optim.warmup_steps,
        decay_steps=max(decay, optim.warmup_steps + 1),
        end_value=optim.lr * optim.min_lr_ratio,
    )


def update_rule(optim, steps: int, matrices: Matrices | None = None
                ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The named update rule on its schedule, without clipping: the trainer clips with the
    norm its update pass already computed (jaxpar.step.update), optax's arithmetic. Where
    `make_optimizer`'s chain has the clip, an identity holds its place, so the optimizer
    state has the chain's tree and checkpoints written with either restore into the other."""
    lr = schedule(optim, steps)
    rule = OPTIMIZERS[optim.name](lr, optim, matrices)
    return optax.chain(*([optax.identity()] if optim.clip_norm > 0 else []), rule), lr


def make_optimizer(optim, steps: int, matrices: Matrices | None = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The config's optimizer as one optax chain, for a step written by hand: clipping
    (global norm over every shard of every parameter: the squared norms are summed under
    jit, so sharding cannot change the result), then the update rule."""
    lr = schedule(optim, steps)
    clip = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm > 0 else []
    return optax.chain(*clip, OPTIMIZERS[optim.name](lr, optim, matrices)), lr
