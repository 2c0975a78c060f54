"""Training curves from metrics files (`jaxpar train --metrics-file`, JSON Lines): one PNG of
loss (held-out loss dashed beside it), tokens/s, gradient norm and learning rate, one line per
run, against the rows' `step` (the steps done; files written before jaxpar counted from 1 count
from 0, drawn as they are). Files are read and checked before anything is drawn."""

from __future__ import annotations

import json
import pathlib

from jaxpar.errors import ConfigError

# (metric, panel title); a panel is drawn when some run has the metric
PANELS = (("loss", "loss (held-out dashed)"), ("loss_by_source", "each source's loss (a mixture's)"),
          ("tokens_per_s", "tokens/s"), ("grad_norm", "gradient norm"), ("learning_rate", "learning rate"),
          ("mfu", "MFU"))


def sources(row: dict) -> list[str]:
    """A mixture's sources named in a row (loss_<name> beside tokens_<name>: jaxpar.step.loss)."""
    return [k.removeprefix("loss_") for k in row if k.startswith("loss_") and f"tokens_{k[5:]}" in row]


def read_rows(path: str) -> list[dict]:
    """The rows of a metrics file, refused in one line if it is missing, empty or not JSON Lines."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: no such metrics file (jaxpar train --metrics-file PATH writes one)")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number} is not a JSON object ({e.msg}); a metrics file holds one per line") from None
        if not isinstance(row, dict) or "step" not in row:
            raise ConfigError(f"{path}:{number} has no \"step\"; is it a jaxpar metrics file?")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no rows")
    return rows


def plot(paths: list[str], out: str) -> list[str]:
    """Draw the runs in `paths` into the PNG `out`; returns the panels drawn."""
    runs = {pathlib.Path(p).stem if len({pathlib.Path(q).stem for q in paths}) == len(paths) else p: read_rows(p)
            for p in paths}
    has = lambda m, r: bool(sources(r)) if m == "loss_by_source" else m in r  # noqa: E731
    panels = [(m, title) for m, title in PANELS if any(has(m, r) for rows in runs.values() for r in rows)]
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    columns = 2 if len(panels) > 1 else 1
    rows_of_panels = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(6 * columns, 3.2 * rows_of_panels), squeeze=False)
    for ax, (metric, title) in zip(axes.flat, panels):
        for i, (name, rows) in enumerate(runs.items()):
            color = f"C{i}"
            if metric == "loss_by_source":
                for j, source in enumerate(dict.fromkeys(s for r in rows for s in sources(r))):
                    points = [(r["step"], r[f"loss_{source}"]) for r in rows if f"loss_{source}" in r]
                    ax.plot(*zip(*points), color=f"C{(i + j) % 10}" if len(runs) == 1 else color,
                            linestyle=("-", "--", ":", "-.")[j % 4], linewidth=1.1,
                            label=source if len(runs) == 1 else f"{name} {source}")
                ax.legend(fontsize=8)
                continue
            points = [(r["step"], r[metric]) for r in rows if metric in r]
            if points:
                ax.plot(*zip(*points), color=color, label=name, linewidth=1.2)
            held_out = [(r["step"], r["eval_loss"]) for r in rows if metric == "loss" and "eval_loss" in r]
            if held_out:
                ax.plot(*zip(*held_out), color=color, linestyle="--", marker="o", markersize=3, label=f"{name} held-out")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if metric == "loss":
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    target = pathlib.Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    fig.savefig(partial, dpi=110, format="png")
    plt.close(fig)
    partial.replace(target)  # whole or absent
    return [m for m, _ in panels]
