"""A pipeline timeline as a PNG, stage x time, like the papers' figures: forwards blue,
input gradients green, weight gradients orange, idle grey, each cell numbered by its
microbatch; with virtual stages (interleaved), a chunk's cells carry its own hatching
(chunk 0 plain) and the chunk's number after the microbatch's, "3.1" (matplotlib, off
screen)."""

from __future__ import annotations

import pathlib

from jaxpar.pipeline.schedule import Timeline, bubble_fraction

COLOURS = {"F": "#4c78a8", "B": "#54a24b", "W": "#f58518", None: "#e8e8e8"}
NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
HATCHES = ("", "////", "xxxx", "....")  # by virtual chunk, repeating


def save_png(timeline: Timeline, path: str | pathlib.Path, title: str = "") -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    p, steps = timeline.p, timeline.steps
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * steps + 1.5), 0.5 * p + 1.4), dpi=100)
    for s, row in enumerate(timeline.grid):
        for t, op in enumerate(row):
            kind = None if op is None else op.kind
            hatch = HATCHES[op.chunk % len(HATCHES)] if op is not None and timeline.v > 1 else ""
            ax.add_patch(Rectangle((t, p - 1 - s), 1, 1, facecolor=COLOURS[kind], edgecolor="white", linewidth=0.5,
                                   hatch=hatch))
            first = op is not None and (t == 0 or row[t - 1] is not op)
            if first:
                label = f"{op.microbatch}.{op.chunk}" if timeline.v > 1 else str(op.microbatch)
                ax.text(t + 0.5, p - 0.5 - s, label, ha="center", va="center", fontsize=6 if timeline.v > 1 else 7,
                        color="white", bbox={"facecolor": COLOURS[kind], "edgecolor": "none", "pad": 0.5} if hatch else None)
    ax.set_xlim(0, steps)
    ax.set_ylim(0, p)
    ax.set_yticks([p - 0.5 - s for s in range(p)], [f"stage {s}" for s in range(p)])
    ax.set_xlabel("time step")
    kinds = sorted({op.kind for row in timeline.grid for op in row if op is not None}, key="FBW".index)
    chunks = [Patch(facecolor="#9a9a9a", edgecolor="white", hatch=HATCHES[c % len(HATCHES)], label=f"chunk {c}")
              for c in range(timeline.v)] if timeline.v > 1 else []
    ax.legend(handles=[Patch(color=COLOURS[k], label=NAMES[k]) for k in kinds] + [Patch(color=COLOURS[None], label="idle")]
              + chunks,
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if p > 2 else -0.45), ncol=4 + timeline.v * (timeline.v > 1), frameon=False, fontsize=8)
    ax.set_title(title or f"p={p}, m={timeline.m}, v={timeline.v}: bubble {bubble_fraction(timeline):.1%}", fontsize=9)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
