"""Held-out batches: what the loss is evaluated on (train.eval_every), never trained on.

Every evaluation reads the same train.eval_batches global batches, numbered 0, 1, ..., so
the held-out losses of a run compare with each other. Where they come from:

  - a synthetic source: held-out batch i is the source's batch at step HELD_OUT_STEP + i.
    Its random stream is seeded with the words (train.seed, i, 2**30), a training step's
    with (train.seed, step): the streams differ in their third word, so a held-out batch is
    drawn apart from every training batch (the same language or teacher, other samples).
  - a token file or text (data.source=tokens or text): the last data.eval_fraction share of
    its token stream is held out. Training rows are drawn only from the part before it
    (jaxpar.data.order.split_tokens, applied by jaxpar.data.sources.TokenFile), held-out
    rows only from the part after: no token of the held-out part is ever trained on. With data.order=windows
    held-out windows are drawn as training windows are, at step HELD_OUT_STEP + i; with
    data.order=epochs held-out batch i holds the held-out part's rows i * B to (i + 1) * B - 1
    in stream order, wrapping round (jaxpar.data.order.Epochs, unshuffled). With
    data.eval_fraction=0 the whole stream trains, as before there was evaluation.
  - the user's own batches (jaxpar.train.run(data=...)): run(eval_data=...), in the format
    of `data` (jaxpar.data.user): a function i -> host-local batch, or an iterable whose
    first train.eval_batches batches are kept and read at every evaluation.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import jax

from jaxpar.data.batch import BatchLayout
from jaxpar.data.order import Epochs, Windows
from jaxpar.data.chat import ChatRows
from jaxpar.data.mixture import Mixture
from jaxpar.data.sources import ChatSource, Source, TokenFile, TokenRows, make_source
from jaxpar.data.user import UserBatches, UserData, check_batch
from jaxpar.errors import ConfigError

HELD_OUT_STEP = 1 << 62  # held-out batch i is a synthetic source's batch at this step + i
HeldOut = Callable[[int], dict[str, jax.Array]]  # i -> held-out global batch i


class HeldOutTokens(TokenRows):
    """The held-out part of a token file's or text's stream (`source`, the training
    source), its rows placed as the module docstring says."""

    def __init__(self, source: TokenFile):
        data = source.data
        if not len(source.held_out):
            raise ConfigError(
                f"data.eval_fraction={data.eval_fraction:g} holds none of data.path={data.path!r} out of training; "
                "set data.eval_fraction=0.01 (its last 1%)"
            )
        rows, seq = source.batch.shapes["inputs"]
        n, seed = len(source.held_out), source.seed
        order = (Windows(n, seq, rows, seed) if isinstance(source.order, Windows)
                 else Epochs(n, seq, rows, seed, shuffle=False, first_step=HELD_OUT_STEP))
        super().__init__(source.batch, source.held_out, order, data.eos_id)


class HeldOutChat(Source):
    """The held-out conversations of a chat source, packed: held-out batch i holds their rows
    i * B to (i + 1) * B - 1 in order, wrapping round."""

    def __init__(self, source: ChatSource):
        if source.held_out is None:
            raise ConfigError(f"data.eval_fraction=0 holds none of data.path={source.data.path!r} out of training; "
                              "set data.eval_fraction=0.01 (its last 1%)")
        super().__init__(source.batch)
        self.reader = ChatRows(source.held_out, "epochs", source.batch.global_batch, source.seed, shuffle=False,
                               first_step=HELD_OUT_STEP)

    def local(self, step: int, rows: slice) -> dict:
        return self.reader.local(step, rows)


def held_out_batches(batch: BatchLayout, config: Any, eval_data: UserData | None = None, source=None) -> HeldOut:
    """i -> held-out global batch i, laid out as `batch`, for 0 <= i < train.eval_batches:
    from `eval_data` when given (checked now), else from the config's source (see the
    module docstring): `source`, the run's own when it has opened it (a text corpus is then
    tokenized once), else opened now."""
    if eval_data is not None:
        return user_held_out(batch, eval_data, config.train.eval_batches)
    source = make_source(batch, config) if source is None else source
    if isinstance(source, Mixture):  # each source's own held-out part, at the mixture's first weights
        source = source.held_out(held_out_part, HELD_OUT_STEP)
    source = held_out_part(source)
    return lambda i: source(HELD_OUT_STEP + i)


def held_out_part(source: Source) -> Source:
    """A training source's held-out counterpart (the module docstring); a synthetic one is its own."""
    if isinstance(source, TokenFile):
        return HeldOutTokens(source)
    if isinstance(source, ChatSource):
        return HeldOutChat(source)
    return source


def user_held_out(batch: BatchLayout, eval_data: UserData, count: int) -> HeldOut:
    """The user's held-out batches; an iterable's first `count` are kept, and each checked,
    a function's first batch is checked; both before anything compiles."""
    kept = None
    if not callable(eval_data):
        kept = list(itertools.islice(eval_data, count))
        if len(kept) < count:
            raise ConfigError(f"eval_data: the iterable holds {len(kept)} batches but train.eval_batches={count}; "
                              f"give at least {count}, or lower train.eval_batches")
        eval_data = kept.__getitem__
    source = UserBatches(batch, eval_data)
    try:
        source.peek(0)
        for one in kept or ():
            check_batch(one, source.expected, source.rows, source.ids_below)
    except ConfigError as e:  # its messages begin "data: "
        raise ConfigError(f"eval_{e}") from None
    return source
