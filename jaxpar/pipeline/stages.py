"""A model cut into pipeline stages: which piece runs where, as the executor's three
functions (jaxpar.pipeline.executor.Stages).

The model provides the pieces (jaxpar.model.PipelineStages: `embed`, `apply_layers` over
whatever layers its `layers` holds, `output`); a stage rebuilds the model from the weights
it holds, with only its chunk of the layer stack, so one model definition serves every
stage. The embedding runs on the first virtual stage, the output and the loss on the last
(their cost lands on those two stages: `jaxpar explain` shows the split).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxpar.pipeline.executor import Stages, no_report, to_model_order, to_pipeline_order
from jaxpar.train.loss import LossFn

LAYERS = "layers"  # the key of the stacked layers in the model's parameter tree


def split_layers(params: dict) -> tuple[Any, dict]:
    """(the stacked layers, every other weight)."""
    return params[LAYERS], {k: v for k, v in params.items() if k != LAYERS}


def join_layers(layers: Any, other: dict) -> dict:
    return {**other, LAYERS: layers}


def in_pipeline_order(tree: Any, p: int, v: int) -> Any:
    """Every array under a "layers" key of `tree` (parameters, gradients, optimizer state,
    a whole TrainState) put in pipeline order (`to_pipeline_order`)."""
    return _under_layers(tree, lambda a: to_pipeline_order(a, p, v), p, v)


def in_model_order(tree: Any, p: int, v: int) -> Any:
    """The inverse of `in_pipeline_order`."""
    return _under_layers(tree, lambda a: to_model_order(a, p, v), p, v)


def _under_layers(tree: Any, fn, p: int, v: int) -> Any:
    """`fn` on the arrays under a "layers" key that are stacked over the layers (an
    optimizer's placeholders or per-layer scalars of other shapes are left alone)."""

    def one(path, x):
        stacked = getattr(x, "ndim", 0) >= 1 and x.shape[0] % (p * v) == 0 and x.shape[0] >= p * v
        return fn(x) if stacked and any(getattr(k, "key", None) == LAYERS for k in path) else x

    return jax.tree_util.tree_map_with_path(one, tree)


def model_stages(graphdef: nnx.GraphDef, loss_fn: LossFn) -> Stages:
    """Stages of any model that implements jaxpar.model.PipelineStages, scored on the last
    stage by `loss_fn(outputs, microbatch) -> (loss sum, weight)`, with the report of the
    layers (an empty one where `apply_layers` returns x alone, not (x, report))."""

    def model(chunk: Any, other: dict):
        return nnx.merge(graphdef, join_layers(chunk, other))

    def layers(net, x, mb):
        out = net.apply_layers(x, mb)
        return out if isinstance(out, tuple) else (out, no_report())

    def first(chunk, other, mb):
        net = model(chunk, other)
        return layers(net, net.embed(mb), mb)

    def mid(chunk, other, x, mb):
        return layers(model(chunk, other), x, mb)

    def last(chunk, other, x, mb):
        net = model(chunk, other)
        x, report = layers(net, x, mb)
        return (*loss_fn(net.output(x), mb), report)

    return Stages(first, mid, last, aux=True)
