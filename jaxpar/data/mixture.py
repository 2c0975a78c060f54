"""data.source=mix: batches drawn from several sources by the weights of data.mix and
data.mix_schedule (jaxpar.data.mixing says which source each row comes from).

Each source is one of jaxpar's own (a token file, a text corpus, chat, synthetic), opened
with the data section's other fields and a seed of its own, and read in its own order: source
s's j-th row is row j % B of its step j // B, as if it were the run's only source with the
run's batch B. So each keeps what it guarantees alone (documents never cut across sources,
its held-out part, data.order), every process reads only its rows, and a batch is a pure
function of (seed, step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jaxpar.data.batch import BatchLayout
from jaxpar.data.mixing import MixEntry, Schedule, assign, offsets, parse_mix, parse_schedule
from jaxpar.data.sources import OPENERS, ChatSource, Source, SyntheticTokens, TextSource, TokenFile, counted


def source_seed(seed: int, index: int) -> int:
    """Source `index`'s seed: a stream of its own, apart from the run's other sources'."""
    return int(np.random.SeedSequence([seed, 1 << 27, index]).generate_state(1)[0])


def open_entry(entry: MixEntry, index: int, batch: BatchLayout, data: Any, vocab_size: int, seed: int) -> Source:
    """One source of the mixture, as data.source=<its kind> would open it alone."""
    own = dataclasses.replace(data, source=entry.kind, path=entry.path, mix="", mix_schedule="")
    mine = source_seed(seed, index)
    if entry.kind == "synthetic":
        return SyntheticTokens(batch, vocab_size, mine, data.eos_id)
    return {"tokens": TokenFile, "text": TextSource, "chat": ChatSource}[entry.kind](batch, own, vocab_size, mine)


class Mixture(Source):
    """The batches of data.mix (the module docstring). `sources`: each entry's, opened."""

    def __init__(self, batch: BatchLayout, entries: tuple[MixEntry, ...], sources: list[Source], schedule: Schedule,
                 seed: int, step_offset: int = 0):
        super().__init__(batch)
        self.entries, self.sources, self.schedule = entries, sources, schedule
        self.u, self.step_offset = offsets(seed, len(entries)), step_offset

    @classmethod
    def open(cls, batch: BatchLayout, data: Any, vocab_size: int, seed: int, steps: int) -> "Mixture":
        entries = parse_mix(data.mix)
        schedule = parse_schedule(data.mix_schedule, tuple(e.weight for e in entries), steps)
        sources = [open_entry(e, i, batch, data, vocab_size, seed) for i, e in enumerate(entries)]
        return cls(batch, entries, sources, schedule, seed)

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        step -= self.step_offset
        source, index = (a[rows] for a in assign(self.schedule, self.batch.global_batch, step, self.u))
        out = {k: np.zeros((len(source), *f.shape), f.dtype) for k, f in self.batch.fields.items()}
        for s in np.unique(source):
            where = source == s
            got = self.rows_of(int(s), index[where])
            for k in out:
                out[k][where] = s if k == "source" else got[k] if k in got else _default(k, got["inputs"])
        return out

    def rows_of(self, s: int, js: np.ndarray) -> dict[str, np.ndarray]:
        """Source s's rows `js` (increasing): row j % B of its step j // B, read a step's
        span at a time."""
        batch, sub = self.batch.global_batch, self.sources[s]
        parts = []
        for step in np.unique(js // batch):
            mine = js[js // batch == step] % batch
            got = sub.local(self.step_offset + int(step), slice(int(mine.min()), int(mine.max()) + 1))
            parts.append({k: v[mine - mine.min()] for k, v in got.items()})
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def held_out(self, wrap: Callable[[Source], Source], first_step: int) -> "Mixture":
        """The held-out mixture: each source's held-out part (`wrap`, jaxpar.data.heldout's),
        at the mixture's first weights, held-out batch i at step `first_step` + i."""
        constant = Schedule((0,), (self.schedule.weights[0],), None, 0)
        return Mixture(self.batch, self.entries, [wrap(s) for s in self.sources], constant, 0, first_step)

    def describe(self, steps: int) -> str:
        """The sources, their weights (first and last where a schedule moves them), the tokens
        each holds and the epochs of it train.steps read."""
        rows = self.schedule.cumulative(steps) * self.batch.global_batch
        last = self.schedule.at(steps - 1) if steps else self.schedule.at(0)
        parts = []
        for entry, source, first, end, n in zip(self.entries, self.sources, self.schedule.weights[0], last, rows):
            weight = f"{first:g}" if abs(first - end) < 1e-9 else f"{first:g} -> {end:g}"
            parts.append(f"{entry.name} ({entry.kind}{' ' + repr(entry.path) if entry.path else ''}) {weight}"
                         f"{_holds(source, n)}")
        moves = f", {len(self.schedule.starts) - 1 + bool(self.schedule.anneal)} change(s) of weights" \
            if len(self.schedule.starts) > 1 or self.schedule.anneal else ""
        return (f"data: a mixture of {len(self.entries)} sources{moves} | " + " | ".join(parts)
                + f" | {counted(steps, 'step')} x {self.batch.global_batch:,} rows")


def _holds(source: Source, rows: float) -> str:
    """', 1.2M tokens, 0.5 epochs': what a source holds and how much of it `rows` rows read."""
    batch = source.batch.global_batch
    if isinstance(source, TokenFile):
        return f", {len(source.tokens):,} tokens, {source.order.epochs(rows / batch):.3g} epochs"
    if isinstance(source, ChatSource):
        return f", {counted(source.reader.rows.conversations, 'conversation')}, " \
               f"{source.reader.order.epochs(rows / batch):.3g} epochs"
    return f", {rows:,.0f} rows"


def _default(field: str, inputs: np.ndarray) -> np.ndarray:
    """What a source that does not pack documents gives for a field the mixture's batch has
    (another source packs them): one document per row."""
    if field == "positions":
        return np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape)
    if field == "segment_ids":
        return np.zeros(inputs.shape, np.int32)
    raise KeyError(f"mixture: a source gave no {field!r}")


OPENERS["mix"] = lambda batch, config: Mixture.open(batch, config.data, config.model.vocab_size, config.train.seed,
                                                    config.train.steps)
