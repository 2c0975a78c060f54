"""`jaxpar plot RUN.jsonl [RUN.jsonl ...] [--out FILE.png]`: training curves of one or several
runs' metrics files in one picture (jaxpar.curves)."""

from __future__ import annotations


def add_parser(sub) -> None:
    plot = sub.add_parser("plot", help="draw runs' metrics files (loss, tokens/s, gradient norm, learning rate) as a PNG")
    plot.add_argument("metrics", nargs="+", metavar="RUN.jsonl", help="metrics files (jaxpar train --metrics-file)")
    plot.add_argument("--out", default="curves.png", metavar="FILE.png", help="the picture (default curves.png)")


def run(args) -> int:
    from jaxpar.curves import plot

    panels = plot(args.metrics, args.out)
    print(f"wrote {args.out}: {', '.join(panels)} of {len(args.metrics)} run{'s' if len(args.metrics) > 1 else ''}")
    return 0
