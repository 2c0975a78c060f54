"""Nothing reaches a GPU uncompiled: every shipped recipe (`jaxpar recipes`) and every golden
checkpoint (a tests/golden folder with a config.json, as `hf:tests/golden/NAME`) compiled for
8 H100s without one, with what a GPU run resolves (parallel.attention=auto: cuDNN where it
applies; expert_exchange=auto: ragged; compiler.preset=auto: overlap), and again in the
variants users turn on (FP8 projections, full remat). One line each: recipe, variant, layout,
resolved attention kernel, compile seconds, memory per device, and OK, REFUSED (a ConfigError
before compile: one line, as the checks promise) or FAILED with the first line of the error.

  python benchmarks/gpu_compile.py                      # every recipe x default,fp8,remat (40-50 min, 2 cores)
  python benchmarks/gpu_compile.py --only deepseek,hf:tests/golden/qwen3 --variants default
  python benchmarks/gpu_compile.py --variants offload   # model.remat=offload too (a GPU-only path)
  python benchmarks/gpu_compile.py --show [markdown]    # the table of the last run, nothing compiled
  ... [--target benchmarks/targets/h100.pbtxt] [--devices 8] [--timeout 1800]
      [--out benchmarks/results/gpu_compile.json]

Needs the CUDA plugin (pip install 'jax[cuda13]'), not a GPU: the devices come from
jaxpar.deviceless, as `jaxpar explain RECIPE --target FILE` gets them, the config from the
recipe as `explain` resolves it (a recipe's mesh is the layout it was written for), and the
step is jaxpar.train.build's, lowered on abstract inputs and compiled by XLA's GPU compiler.
Each compile runs in a child process with a time limit (XLA can abort the process it compiles
in), so one crash or hang is one FAILED line. The JSON is rewritten after each compile; a
partial run (--only, or other --variants) replaces only its own rows in it. Exit status 1 if
a compile failed or compiled without what it resolved to (cuDNN attention, FP8 GEMMs,
activations offloaded to host memory).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = "tests/golden"
# name -> the overrides it adds to the recipe (default: the recipe as written, resolved for GPUs)
VARIANTS = {
    "default": [],
    "fp8": ["train.matmul_dtype=fp8"],
    "remat": ["model.remat=full"],
    "offload": ["model.remat=offload"],  # pinned-host activations: a path only GPUs compile
}
DEFAULT_VARIANTS = "default,fp8,remat"
OUTCOMES = ("OK", "REFUSED", "FAILED")
TOLD = "gpu_compile: so far "  # a child's stderr line: the row before the phase it starts (JSON)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="benchmarks/targets/h100.pbtxt", help="GpuTargetConfig file of the GPU")
    p.add_argument("--devices", type=int, default=8, help="GPUs on one host (the shipped recipes are written for 8)")
    p.add_argument("--only", help="comma-separated recipes (names, or hf:FOLDER) instead of all of them")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one compile may take before it is stopped")
    p.add_argument("--out", default="benchmarks/results/gpu_compile.json")
    p.add_argument("--show", nargs="?", const="text", choices=["text", "markdown"],
                   help="print the table of --out's earlier run (text, or markdown); compile nothing")
    p.add_argument("--one", nargs=2, metavar=("RECIPE", "RESULT"), help=argparse.SUPPRESS)  # the child
    p.add_argument("--set", dest="overrides", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; use some of {', '.join(VARIANTS)}")
    return args


def recipes_to_compile(root: pathlib.Path = ROOT) -> list[str]:
    """Every shipped recipe, then every golden checkpoint folder (one with a config.json: not
    the chat fixtures or the PEFT adapter) as an hf: recipe, relative to `root`."""
    from jaxpar import recipes

    folders = sorted(p.name for p in (root / GOLDEN).iterdir() if (p / "config.json").is_file())
    return recipes.names() + [f"hf:{GOLDEN}/{name}" for name in folders]


# --- the child: one recipe and variant, compiled here ---------------------------------------


def compile_one(recipe: str, overrides: list[str], target: str, num_devices: int) -> dict:
    """One row: what the recipe resolves to on the GPUs, and its outcome. A ConfigError before
    XLA compiles is REFUSED (its phase says whether the checks or the trace raised it); any
    other error is FAILED."""
    from jaxpar.recipes import resolve_config
    from jaxpar.deviceless import gpu_devices

    devices = gpu_devices(target, f"1x1x{num_devices}")
    row, phase = {"device_kind": devices[0].device_kind}, "config"
    try:
        config = resolve_config(recipe, overrides, num_devices)
        row.update(resolved(config, num_devices))
        phase = "build"
        from jaxpar.train import build

        trainer = build(config, devices)
        row.update(attention=attention_kernel(trainer), layout=layout_text(trainer.mesh.shape, config))
        phase = tell(row, "trace")
        state, batch = trainer.abstract_state(), trainer.abstract_batch()
        t0 = time.perf_counter()
        lowered = trainer.step.lower(state, batch)
        t1 = time.perf_counter()
        phase = tell(row, "compile")
        compiled = lowered.compile()
        t2 = time.perf_counter()
    except Exception as e:  # noqa: BLE001 -- every error is this row's outcome
        return {**row, **failure(e, phase)}
    row = {**row, "outcome": "OK", "trace_s": t1 - t0, "compile_s": t2 - t0, **program_facts(compiled)}
    return {**row, "missing": missing_kernels(row)}


def tell(row: dict, phase: str) -> str:
    """Say on stderr what is known so far and which phase starts: if the process dies in it,
    the parent's row keeps them (known_before_death)."""
    print(TOLD + json.dumps({**row, "phase": phase}, default=str), file=sys.stderr, flush=True)
    return phase


def failure(e: Exception, phase: str) -> dict:
    """The outcome of an error raised in `phase` (config, build, trace, compile): REFUSED for a
    ConfigError before XLA compiles (the user sees its one line, no traceback), else FAILED."""
    from jaxpar.errors import ConfigError

    refused = isinstance(e, ConfigError) and phase != "compile"
    return {"outcome": "REFUSED" if refused else "FAILED", "phase": phase, "message": first_line(e),
            "where": innermost_frame(e), "traceback": traceback.format_exception(e)[-12:]}


def resolved(config, num_devices: int) -> dict:
    """The config's settings this report shows, and the layout its mesh resolves to (the
    recipe's axes as written if they do not fit the devices)."""
    try:
        sizes = config.mesh.resolve(num_devices)
    except Exception:  # noqa: BLE001 -- the build below says why, in its own words
        sizes = {a: getattr(config.mesh, a) for a in ("stage", "data", "fsdp", "expert", "context", "tensor")}
    return {"model": type(config.model).__name__, "layout": layout_text(sizes, config),
            "remat": getattr(config.model, "remat", "-"), "compute_dtype": config.train.compute_dtype,
            "matmul_dtype": config.train.matmul_dtype, "attention_setting": config.parallel.attention}


def layout_text(sizes, config) -> str:
    """'data=2 fsdp=2 tensor=2 zero1 remat=full': the mesh axes above 1, ZeRO stage, remat."""
    axes = " ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "single device"
    zero = f" zero{config.parallel.zero.stage}" if config.parallel.zero.stage else ""
    remat = getattr(config.model, "remat", None)
    return f"{axes}{zero}{f' remat={remat}' if remat not in (None, 'none') else ''}"


def attention_kernel(trainer) -> str:
    """The kernel an attention call runs under the trainer's layout (jaxpar.sharding.attend):
    the context-parallel one when the sequence is sharded, else layout.attention."""
    from jaxpar.model import ATTENTION, supports
    from jaxpar.sharding.attend import sequence_degree

    if not supports(trainer.config.model, ATTENTION):
        return "-"
    layout = trainer.layout
    if sequence_degree(layout) > 1:
        return f"{layout.context.impl}/{layout.context.kernel}"
    return layout.attention


def program_facts(compiled) -> dict:
    """Memory per device (arguments + outputs + temporaries - donated, as jaxpar explain counts
    it; and in host memory), the library calls, and the GEMMs by operand types: evidence that
    what the row resolved to (cuDNN attention, FP8 projections, offloaded activations) is in
    the program."""
    import re

    from jaxpar.inspect.hlo import dot_types

    stats = compiled.memory_analysis()
    text = compiled.as_text()
    return {"memory_bytes": stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes, "temp_bytes": stats.temp_size_in_bytes,
            "host_temp_bytes": stats.host_temp_size_in_bytes,  # pinned host memory: remat=offload's activations
            "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))), "gemms": dot_types(text)}


def missing_kernels(row: dict) -> list[str]:
    """What the row resolved to but its compiled program lacks: a setting that did nothing."""
    missing = []
    if row.get("attention") == "cudnn" and not any(c.startswith("__cudnn$fmha") for c in row["custom_calls"]):
        missing.append("attention resolved to cudnn, but the program calls no cuDNN fused attention")
    if row.get("matmul_dtype") == "fp8" and not any("f8" in types for types in row["gemms"]):
        missing.append("train.matmul_dtype=fp8, but no GEMM in the program reads FP8 operands")
    if row.get("remat") == "offload" and not row.get("host_temp_bytes"):
        missing.append("model.remat=offload, but nothing rests in host memory during the step")
    return missing


def first_line(e: BaseException) -> str:
    said = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    text = f"{type(e).__name__}: {said}" if said else type(e).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def innermost_frame(e: BaseException) -> str:
    """file:line function of the deepest frame in this repository (not JAX's): where to look."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(str(ROOT))
              and "/.venv" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}"


def child(args) -> int:
    recipe, result = args.one
    row = compile_one(recipe, args.overrides, args.target, args.devices)
    pathlib.Path(result).write_text(json.dumps(row, default=str))
    return 0


# --- the parent: every recipe x variant, each in a child --------------------------------------


def run_child(recipe: str, overrides: list[str], args) -> dict:
    """The child's row, or a FAILED row saying how it died (abort, kill, time limit)."""
    from jaxpar.plan.compile_one import _cause  # jaxpar plan's one-line reason for a dead child

    command = [sys.executable, __file__, "--target", args.target, "--devices", str(args.devices),
               *(f"--set={o}" for o in overrides)]
    with tempfile.TemporaryDirectory(prefix="jaxpar-gpu-compile-") as tmp:
        result = os.path.join(tmp, "row.json")
        try:
            done = subprocess.run([*command, "--one", recipe, result], cwd=ROOT, capture_output=True, text=True,
                                  errors="replace", timeout=args.timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        except subprocess.TimeoutExpired as e:
            said = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
            known, _ = known_before_death(said)
            return {**known, "outcome": "FAILED", "message": f"took longer than {args.timeout:g} s; stopped it"}
        if done.returncode == 0 and os.path.exists(result):
            return json.loads(pathlib.Path(result).read_text())
    known, said = known_before_death(done.stderr or done.stdout)
    return {**known, "outcome": "FAILED", "message": _cause(done.returncode, said)}


def known_before_death(output: str) -> tuple[dict, str]:
    """The last row a child told, with the phase it was in ("start" if it told none), and its
    output without those lines."""
    told = [line[len(TOLD):] for line in output.splitlines() if line.startswith(TOLD)]
    rest = "\n".join(line for line in output.splitlines() if not line.startswith(TOLD))
    return (json.loads(told[-1]) if told else {"phase": "start"}), rest


HEADER = f"{'recipe':34s} {'variant':7s} {'layout':40s} {'attention':12s} {'compile':>8s} {'mem/dev':>9s}  outcome"


def line(row: dict) -> str:
    """The row's one line under HEADER."""
    seconds = f"{row['compile_s']:7.1f}s" if "compile_s" in row else f"{'-':>8s}"
    memory = f"{row['memory_bytes'] / 2**20:7.1f}Mi" if "memory_bytes" in row else f"{'-':>9s}"
    return (f"{row['recipe']:34s} {row['variant']:7s} {row.get('layout', '?'):40s} {row.get('attention', '?'):12s} "
            f"{seconds} {memory}  {outcome(row)}")


def outcome(row: dict) -> str:
    """OK (and any kernel it lacks), or REFUSED / FAILED (phase): the error's first line."""
    if row["outcome"] == "OK":
        return "; ".join(["OK", *row.get("missing", [])])
    return f"{row['outcome']} ({row.get('phase', '?')}): {row['message']}"


def summary(rows: list[dict]) -> dict:
    return {**{o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES},
            "missing_kernels": sum(bool(r.get("missing")) for r in rows)}


def summary_line(counts: dict) -> str:
    return (f"{counts['OK']} ok ({counts['missing_kernels']} without what they resolved to), "
            f"{counts['REFUSED']} refused, {counts['FAILED']} failed")


def this_run(args, device_kind: str) -> dict:
    import jax
    import jaxlib

    def git(*command) -> str:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"target": args.target, "device_kind": device_kind, "devices": args.devices, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--untracked-files=no").splitlines(),
            "only": args.only, "variants": {v: VARIANTS[v] for v in args.variants.split(",")}}


def markdown(rows: list[dict]) -> list[str]:
    """docs/testing.md's table: a row per recipe, a column per variant (OK: compile seconds and
    MiB per device), the layout and attention of its default; then each outcome not OK, whole."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by_recipe: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_recipe.setdefault(r["recipe"], {})[r["variant"]] = r

    def cell(r: dict | None) -> str:
        if r is None:
            return ""
        if r["outcome"] != "OK":
            return f"**{r['outcome']}**"
        missing = " (see below)" if r.get("missing") else ""
        return f"{r['compile_s']:.0f} s, {r['memory_bytes'] / 2**20:.1f} MiB{missing}"

    lines = [f"| recipe | layout | attention | {' | '.join(variants)} |", "|---" * (3 + len(variants)) + "|"]
    for recipe, each in by_recipe.items():
        first = each.get("default") or next(iter(each.values()))
        lines.append(f"| {recipe} | {first.get('layout', '?')} | {first.get('attention', '?')} | "
                     + " | ".join(cell(each.get(v)) for v in variants) + " |")
    not_ok = [r for r in rows if r["outcome"] != "OK" or r.get("missing")]
    return lines + [""] + [f"- {r['recipe']} {r['variant']}: {outcome(r)}" for r in not_ok]


def show(out: pathlib.Path, form: str) -> int:
    """The table of an earlier run's JSON (text, or markdown for docs/testing.md); nothing compiled."""
    doc = json.loads(out.read_text())
    print("\n".join(markdown(doc["rows"]) if form == "markdown" else [HEADER, *map(line, doc["rows"])]))
    print(f"{summary_line(summary(doc['rows']))}; full run {doc.get('wall_s', 0):.0f} s "
          f"(+{sum(u['wall_s'] for u in doc.get('updates', [])):.0f} s of partial runs since)")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        return child(args)
    out = pathlib.Path(args.out)
    if args.show:
        return show(out, args.show)
    from jaxpar.deviceless import gpu_devices
    from jaxpar.errors import ConfigError

    try:  # the plugin and target file, checked once (the children describe the GPUs again)
        device_kind = gpu_devices(args.target, f"1x1x{args.devices}")[0].device_kind
    except ConfigError as e:
        print(f"gpu_compile: {e}", file=sys.stderr)
        return 2
    names = args.only.split(",") if args.only else recipes_to_compile()
    todo = [(r, v) for r in names for v in args.variants.split(",")]
    run = this_run(args, device_kind)
    if (args.only or args.variants != DEFAULT_VARIANTS) and out.exists():  # a partial run updates its rows
        doc = json.loads(out.read_text())
        doc["rows"] = [r for r in doc["rows"] if (r["recipe"], r["variant"]) not in set(todo)]
        doc["updates"] = [*doc.get("updates", []), run]
    else:
        doc = {**run, "rows": [], "updates": []}
        run = doc
    print(f"{len(todo)} compiles for {args.devices} x {device_kind} (deviceless), variants {args.variants}, "
          f"{args.timeout:g} s each at most", flush=True)
    print(HEADER, flush=True)
    start, run["wall_s"] = time.perf_counter(), 0.0
    for i, (recipe, variant) in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {recipe} {variant} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        row = {"recipe": recipe, "variant": variant, "overrides": VARIANTS[variant],
               **run_child(recipe, VARIANTS[variant], args), "wall_s": round(time.perf_counter() - t0, 1)}
        doc["rows"].append(row)
        print(line(row), flush=True)
        run["wall_s"] = round(time.perf_counter() - start, 1)
        doc["summary"] = summary(doc["rows"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=str))
    mine = summary([r for r in doc["rows"] if (r["recipe"], r["variant"]) in set(todo)])
    print(f"{summary_line(mine)}; {run['wall_s']:.0f} s; wrote {out}")
    return 1 if mine["FAILED"] or mine["missing_kernels"] else 0


if __name__ == "__main__":
    sys.exit(main())
