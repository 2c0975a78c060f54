"""Where in a token stream the rows of a batch start (data.order), and where the stream
splits into its training and held-out parts (`split_tokens`, data.eval_fraction). Each start
is a pure function of (seed, step) and of the global rows asked for, so a process builds
only its own rows and a run resumed at any step, on any number of processes, sees the
batches of an uninterrupted one.

  - windows: seq_len + 1 tokens at positions drawn uniformly from (seed, step), 0 to
    n_tokens - seq_len - 1 (the last window ends on the last token); rows may overlap and
    repeat, and no epoch is ever complete.
  - epochs: the stream cut into consecutive rows of seq_len + 1 tokens, row r starting at
    r * seq_len (consecutive rows share one token, so every token after the first is a target
    exactly once per epoch; a tail shorter than a row is left out). The run reads one endless
    sequence of rows, every row once per epoch in an order drawn from (seed, epoch): global
    batch s holds its rows s * B to (s + 1) * B - 1.
"""

from __future__ import annotations

import numpy as np

from jaxpar.errors import ConfigError

# The epochs' permutations are seeded with (seed, epoch, EPOCH_STREAM): a stream of their own,
# apart from the windows' (seed, step) and the held-out (seed, i, 2**30) streams.
EPOCH_STREAM = 1 << 29


class Windows:
    """data.order=windows: the start of every row of step `step`, drawn from (seed, step)."""

    def __init__(self, n_tokens: int, seq_len: int, batch: int, seed: int):
        self.n_tokens, self.seq_len, self.batch, self.seed = n_tokens, seq_len, batch, seed

    def epochs(self, steps: int) -> float:
        """How many times `steps` steps read the stream's tokens over (whole rows: its rows),
        on average: the windows fall at random, so some tokens are read more, some never."""
        return steps * self.batch * max(self.seq_len, 1) / self.n_tokens

    def starts(self, step: int, rows: slice) -> np.ndarray:
        # A row reads seq_len + 1 tokens, so the last start is n_tokens - seq_len - 1 (the bound is exclusive).
        draw = np.random.default_rng([self.seed, step]).integers(0, self.n_tokens - self.seq_len, size=self.batch)
        return draw[rows]


class Epochs:
    """data.order=epochs (see the module docstring); with shuffle=False the rows in stream
    order, epoch after epoch (held-out batches). Step `first_step` reads the sequence's first
    rows: held-out batch i is asked for as step HELD_OUT_STEP + i."""

    def __init__(self, n_tokens: int, seq_len: int, batch: int, seed: int, shuffle: bool = True, first_step: int = 0):
        self.rows = (n_tokens - 1) // seq_len
        self.seq_len, self.batch, self.seed, self.shuffle, self.first_step = seq_len, batch, seed, shuffle, first_step
        self._permutations: dict[int, np.ndarray] = {}  # the latest two epochs': a batch may straddle two

    def epochs(self, steps: int) -> float:
        """How many epochs `steps` steps read."""
        return steps * self.batch / self.rows

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) == 2:
                del self._permutations[min(self._permutations)]
            rng = np.random.default_rng([self.seed, epoch, EPOCH_STREAM])
            self._permutations[epoch] = rng.permutation(self.rows)
        return self._permutations[epoch]

    def row_ids(self, step: int, rows: slice) -> np.ndarray:
        """The stream's row numbers that rows `rows` of step `step` read."""
        first = (step - self.first_step) * self.batch
        epoch, index = np.divmod(np.arange(first + rows.start, first + rows.stop, dtype=np.int64), self.rows)
        if self.shuffle:
            for e in np.unique(epoch):
                where = epoch == e
                index[where] = self.permutation(int(e))[index[where]]
        return index

    def starts(self, step: int, rows: slice) -> np.ndarray:
        return self.row_ids(step, rows) * self.seq_len


def row_order(order: str, n_tokens: int, seq_len: int, batch: int, seed: int) -> Windows | Epochs:
    """The training rows' placement for data.order=`order` (checked by the config rules)."""
    return Windows(n_tokens, seq_len, batch, seed) if order == "windows" else Epochs(n_tokens, seq_len, batch, seed)


def whole_rows_order(order: str, n_rows: int, batch: int, seed: int, shuffle: bool = True,
                     first_step: int = 0) -> Windows | Epochs:
    """data.order over `n_rows` whole rows (packed conversations, preference pairs): `starts`
    gives row numbers. A row is one unit of the stream: windows draw rows 0 .. n_rows - 1 from
    (seed, step), epochs go through every row once per epoch."""
    if order == "windows":
        return Windows(n_rows, 0, batch, seed)
    return Epochs(n_rows + 1, 1, batch, seed, shuffle, first_step)


def split_tokens(tokens: np.ndarray, fraction: float, seq_len: int, path: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(training part, held-out part) of a file's tokens: the last `fraction` of them,
    rounded down, held out; fraction 0 holds nothing out. Each part that is used holds a
    window of seq_len + 1 tokens and one start position more (seq_len + 2 tokens)."""
    n = len(tokens)
    if not fraction:
        return tokens, tokens[n:]
    held = int(n * fraction)
    need = seq_len + 2
    if held < need or n - held < need:
        low, high = need / n, 1 - need / n
        works = (f"use {low:.3g} to {high:.3g}" if low <= high
                 else f"the file is too short to split; give more than {2 * need} tokens")
        raise ConfigError(
            f"data.eval_fraction={fraction} splits data.path={path!r}, {n} tokens, into {n - held} to train on and "
            f"{held} held out; each part needs train.seq_len + 2 = {need}: {works}"
        )
    return tokens[: n - held], tokens[n - held :]
