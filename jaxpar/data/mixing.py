"""A mixture's recipe (data.source=mix): its sources and their weights over the run, and which
source each row of each step comes from.

  data.mix           "WEIGHT KIND:PATH, ..." e.g. "0.7 text:web/*.txt, 0.2 tokens:code.bin,
                     0.1 chat:math.jsonl": each entry a source of that kind (tokens, text, chat
                     or synthetic, which takes no path), read with the data section's other
                     fields (tokenizer, dtype, eos_id, order, eval_fraction, ...)
  data.mix_schedule  "; "-separated changes of the weights, in order:
                       "STEP=w,w,..."       from step STEP on, these weights
                       "anneal N=w,w,..."   over the run's last N steps, linearly from the
                                            weights then in force to these (OLMo's and Llama 3's
                                            annealing)

Which source a row comes from is exact, not sampled: source s's j-th row sits at the place
on the run's line of rows where its cumulative weight W_s (the sum of its weights over the
rows before) first reaches j + u_s, u_s a fraction drawn from (seed, s); the rows are these
places in order (stride scheduling, as a weighted fair queue interleaves). After any number of
rows each source has given its share within two rows (not a sample: no sampling error), a step's assignment is a pure function of
(seed, step), and source s's j-th row is its own row j (`Mixture` reads it from the source's
own order), so a run resumes exactly on any number of processes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxpar.errors import ConfigError

KINDS = ("tokens", "text", "chat", "synthetic")  # the sources a mixture takes (jaxpar.data.sources)
MIX_STREAM = 1 << 28  # the offsets u_s are drawn from (seed, MIX_STREAM): a stream of their own


@dataclasses.dataclass(frozen=True)
class MixEntry:
    """One source of a mixture: its kind, its path (none for synthetic) and its first weight."""

    kind: str
    path: str
    weight: float

    @property
    def name(self) -> str:
        """How metrics and the start line call it: the path's stem, or the kind."""
        if not self.path:
            return self.kind
        stem = self.path.rstrip("/").split("/")[-1].split(".")[0].replace("*", "")
        return stem or self.kind


def parse_mix(text: str) -> tuple[MixEntry, ...]:
    """data.mix's entries (the module docstring), each checked."""
    entries = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        weight, _, source = part.partition(" ")
        kind, _, path = source.strip().partition(":")
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"data.mix entry {part!r} does not start with a weight; write \"WEIGHT KIND:PATH\", e.g. "
                              "\"0.7 text:web/*.txt\"") from None
        if kind not in KINDS:
            raise ConfigError(f"data.mix entry {part!r}: source {kind!r}; use one of {', '.join(KINDS)}")
        if (kind == "synthetic") != (not path):
            raise ConfigError(f"data.mix entry {part!r}: " + ("synthetic takes no path" if path else
                                                              f"{kind} needs a path, as \"{weight} {kind}:PATH\""))
        entries.append(MixEntry(kind, path, w))
    if len(entries) < 2:
        raise ConfigError(f"data.mix={text!r} names {len(entries)} source(s); a mixture has two or more, e.g. "
                          "\"0.7 text:web.txt, 0.3 tokens:code.bin\" (one source: data.source=text or tokens)")
    check_weights(tuple(e.weight for e in entries), "data.mix")
    names = [e.name for e in entries]
    if len(set(names)) < len(names):
        raise ConfigError(f"data.mix={text!r}: two sources are both called {max(names, key=names.count)!r} (their "
                          "paths' stems); rename a file, so each source's metrics have a name of their own")
    return tuple(entries)


def check_weights(weights: tuple[float, ...], where: str) -> None:
    if any(w < 0 or not math.isfinite(w) for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise ConfigError(f"{where}: weights {', '.join(f'{w:g}' for w in weights)} must be >= 0 and sum to 1 (they "
                          f"sum to {sum(weights):g}); e.g. {', '.join(f'{w / sum(weights):.3g}' for w in weights)}"
                          if sum(weights) > 0 else f"{where}: weights must be >= 0 and sum to 1")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The weights at every step: piecewise constant from the steps given, then (anneal) a
    linear move over the run's last steps."""

    starts: tuple[int, ...]  # each phase's first step, from 0
    weights: tuple[tuple[float, ...], ...]  # each phase's weights
    anneal: tuple[int, tuple[float, ...]] | None = None  # (first step of the anneal, the weights at the run's end)
    steps: int = 0  # the run's length (where the anneal ends)

    def at(self, step: int) -> np.ndarray:
        """Every source's weight at `step`."""
        base = np.asarray(self.weights[int(np.searchsorted(self.starts, step, side="right")) - 1])
        if self.anneal is None or step < self.anneal[0]:
            return base
        first, target = self.anneal
        before = np.asarray(self.weights[int(np.searchsorted(self.starts, first, side="right")) - 1])
        t = (step - first + 1) / (self.steps - first)  # the last step reaches the target
        return (1 - t) * before + t * np.asarray(target)

    def cumulative(self, step: int) -> np.ndarray:
        """Each source's weight summed over the steps before `step` (exactly, phase by phase)."""
        total = np.zeros(len(self.weights[0]))
        edges = [*self.starts, *([self.anneal[0]] if self.anneal else [])]
        for start in sorted(set(edges)):
            if start >= step:
                break
            end = min([e for e in edges if e > start] + [step])
            if self.anneal is not None and start >= self.anneal[0]:
                first, target = self.anneal
                t = lambda s: (s - first + 1) / (self.steps - first)  # noqa: E731
                n = end - start  # sum of t over [start, end): arithmetic
                tsum = n * (t(start) + t(end - 1)) / 2
                before = self.at(first - 1) if first > 0 else np.asarray(self.weights[0])
                total += n * before + tsum * (np.asarray(target) - before)
            else:
                total += (end - start) * self.at(start)
        return total


def parse_schedule(text: str, first: tuple[float, ...], steps: int) -> Schedule:
    """data.mix_schedule (the module docstring) over a run of `steps` steps, from the weights
    data.mix gives."""
    starts, weights, anneal = [0], [first], None
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        when, _, values = part.partition("=")
        try:
            w = tuple(float(v) for v in values.split(","))
        except ValueError:
            w = ()
        if len(w) != len(first):
            raise ConfigError(f"data.mix_schedule entry {part!r}: give {len(first)} weights, one per data.mix source, "
                              f"as \"STEP={','.join(['w'] * len(first))}\"")
        check_weights(w, f"data.mix_schedule entry {part!r}")
        if when.strip().startswith("anneal"):
            n = _int(when.strip().removeprefix("anneal"), part)
            if not 0 < n <= steps:
                raise ConfigError(f"data.mix_schedule entry {part!r} anneals over {n} steps of a run of train.steps="
                                  f"{steps}; use 1 to {steps}")
            anneal = (steps - n, w)
            continue
        step = _int(when, part)
        if anneal is not None or step <= starts[-1] or step >= steps:
            raise ConfigError(f"data.mix_schedule entry {part!r}: steps go up, each inside the run (train.steps="
                              f"{steps}), before any anneal; this one is at step {step}")
        starts.append(step)
        weights.append(w)
    if anneal is not None and anneal[0] < starts[-1]:
        raise ConfigError(f"data.mix_schedule: the anneal starts at step {anneal[0]}, before the change at step "
                          f"{starts[-1]}; anneal over fewer steps")
    return Schedule(tuple(starts), tuple(weights), anneal, steps)


def _int(text: str, part: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"data.mix_schedule entry {part!r}: {text.strip()!r} is not a step; write \"STEP=w,w\" or "
                          "\"anneal N=w,w\"") from None


def offsets(seed: int, count: int) -> np.ndarray:
    """u_s in [0, 1), one per source, drawn from (seed, MIX_STREAM)."""
    return np.random.default_rng([seed, MIX_STREAM]).random(count)


def assign(schedule: Schedule, batch: int, step: int, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's source [batch], its row number within that source [batch]) at `step`.

    On the line of rows, source s's cumulative weight before place x is W_s(x), linear
    inside a step (its weights are the step's); its row j sits where W_s reaches j + u_s, and
    the run's rows are these places in order (ties by source). At most one place per source
    separates a row's rank from its place, so the step's rows are among the places of the
    steps around it: those are listed in closed form, sorted, and ranked from how many
    places come before them (sum over s of the j with j + u_s < W_s)."""
    margin = -(-(len(u) + 1) // batch)  # steps around it that may hold its rows' places
    lo, hi = max(step - margin, 0), step + margin + 1
    edges = np.stack([schedule.cumulative(t) * batch for t in range(lo, hi + 1)])  # W_s at each step's start
    places, sources, indices = [], [], []
    for t in range(lo, hi):
        rate = schedule.at(t)
        for s in np.flatnonzero(rate > 0):
            j = np.arange(np.ceil(edges[t - lo, s] - u[s]), np.ceil(edges[t + 1 - lo, s] - u[s])).astype(np.int64)
            j = j[j >= 0]
            places.append(t * batch + (j + u[s] - edges[t - lo, s]) / rate[s])
            sources.append(np.full(len(j), s, np.int32))
            indices.append(j)
    place, source, index = (np.concatenate(x) for x in (places, sources, indices))
    order = np.lexsort((source, place))
    before = int(np.maximum(np.ceil(edges[0] - u), 0).sum())  # the places before step `lo`
    chosen = order[step * batch - before: (step + 1) * batch - before]
    if len(chosen) != batch:
        raise AssertionError(f"mixture: step {step} found {len(chosen)} of its {batch} rows")
    return source[chosen], index[chosen]
