"""Single-GPU speed against a peer: a 0.9B Llama (16 layers of d=2048, 32k vocabulary) in
bf16, tokens/s and MFU for jaxpar and, side by side in the same run, the same model shape in
PyTorch (Hugging Face transformers' LlamaForCausalLM, SDPA attention, torch.compile,
autocast bf16 with float32 weights and a fused AdamW: the usual mixed-precision recipe, as
jaxpar's float32 master weights). jaxpar's attention is parallel.attention=auto, which is
cuDNN's fused flash attention on GPUs.

  python benchmarks/mfu.py [--steps 20] [--warmup 5] [--out benchmarks/results/mfu.json]
  python benchmarks/mfu.py --tiny     # a toy shape, to check the script on a CPU
  python benchmarks/mfu.py --matmul-dtype fp8 --no-peer   # jaxpar alone, its projections in FP8
  python benchmarks/mfu.py --target benchmarks/targets/h100.pbtxt   # compile only, for an H100, without a GPU
  python benchmarks/mfu.py --shape 3b --remat full --batch 4 --loss-chunks 8   # Llama 3.2 3B's shape, both sides
      # checkpointing every layer (the peer: Hugging Face's gradient checkpointing, under any jaxpar remat but none)

Both sides train on the same shapes (batch x seq tokens of random ids), their step times
are the median of `--steps` timed steps after `--warmup`, and MFU is the model FLOPs
(6 x matmul params + attention, PaLM appendix B, as jaxpar.flops counts them) over the
device's bf16 peak, also with --matmul-dtype fp8 (train.matmul_dtype: jaxpar's projections
multiply in FP8; the peer stays bf16, and --no-peer leaves it out). Each side runs in its own
child process, one after the other in the same call: two frameworks in one process fight over
the GPU's memory (JAX's allocator keeps what it took, and the 0.9B step needs most of an
H100). Without PyTorch (or transformers) the peer column says so.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets

SHAPE = dict(vocab_size=32000, embed=2048, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128, mlp=5632)
# Llama 3.2 3B's shape (tied embeddings, a 128k vocabulary): --shape 3b, the bigger row.
SHAPE_3B = dict(vocab_size=128256, embed=3072, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128, mlp=8192,
                tie_embeddings=True)
SHAPES = {"0.9b": SHAPE, "3b": SHAPE_3B}
TINY = dict(vocab_size=256, embed=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp=128)


def parse_args() -> argparse.Namespace:
    from jaxpar.commands.common import add_overrides

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--remat", default="none", help="jaxpar model.remat (none | full | dots | ...)")
    p.add_argument("--unroll-layers", action="store_true", help="jaxpar model.unroll_layers: the layers in line, "
                   "not a loop")
    p.add_argument("--shape", choices=list(SHAPES), default="0.9b", help="the model: the 0.9B Llama or Llama 3.2 "
                   "3B's shape (both sides)")
    p.add_argument("--tiny", action="store_true", help="a toy shape and 2 x 64 tokens (CPU check)")
    p.add_argument("--matmul-dtype", choices=["compute", "fp8"], default="compute",
                   help="jaxpar train.matmul_dtype: compute (bf16) or fp8 projections")
    p.add_argument("--no-peer", action="store_true", help="measure jaxpar only (no PyTorch side)")
    p.add_argument("--target", help="GpuTargetConfig file: only compile jaxpar's step for that GPU (deviceless; needs "
                   "the CUDA plugin, not a GPU) and report its memory, kernels and FLOPs")
    p.add_argument("--loss-chunks", type=int, default=1, help="jaxpar train.loss_chunks (the loss in that many "
                   "groups of tokens: a 128k vocabulary's logits need them)")
    p.add_argument("--xla-options", default="", help="jaxpar compiler.options for its step, 'name=value,...' "
                   "(e.g. xla_gpu_enable_triton_gemm=false: cuBLAS for every matmul)")
    add_overrides(p, "compiler.uninitialised_stacks=true")  # jaxpar's step only
    p.add_argument("--vocab", type=int, help="with --target: the vocabulary instead of the 0.9B shape's 32000")
    p.add_argument("--out", help="JSON file (default benchmarks/results/mfu.json, or mfu_compile.json with --target)")
    p.add_argument("--side", choices=["jaxpar", "pytorch"], help=argparse.SUPPRESS)  # one side, in a child process
    return p.parse_args()


# The config keys mfu.py's own flags set.
FLAGGED = {"train.global_batch": "--batch", "train.seq_len": "--seq-len", "model.remat": "--remat",
           "model.unroll_layers": "--unroll-layers", "train.matmul_dtype": "--matmul-dtype",
           "train.loss_chunks": "--loss-chunks", "compiler.options": "--xla-options"}


def refuse_flagged(overrides: Sequence[str]) -> None:
    flagged = sorted({key.partition("=")[0].strip() for key in overrides} & set(FLAGGED))
    if flagged:
        raise SystemExit(f"--set {', '.join(flagged)}: use {', '.join(FLAGGED[k] for k in flagged)} instead")


def jaxpar_config(shape: dict, batch: int, seq: int, remat: str, steps: int, matmul_dtype: str = "compute",
                  loss_chunks: int = 1, unroll_layers: bool = False, xla_options: str = "",
                  overrides: Sequence[str] = ()):
    """jaxpar's config of the run; `overrides`: --set's 'key=value's, applied last, for what
    no flag sets (a flag's own key is refused: the run's name and its MFU read the flags)."""
    from jaxpar.config import CompilerConfig, Config, TrainConfig, apply_overrides

    refuse_flagged(overrides)
    from jaxpar.models.llama import LlamaConfig

    config = Config(model=LlamaConfig(**shape, remat=remat, unroll_layers=unroll_layers),
                    train=TrainConfig(global_batch=batch, seq_len=seq, compute_dtype="bfloat16", steps=steps,
                                      matmul_dtype=matmul_dtype, loss_chunks=loss_chunks),
                    compiler=CompilerConfig(options=xla_options))
    return apply_overrides(config, list(overrides))


def jaxpar_steps(shape: dict, batch: int, seq: int, remat: str, steps: int, warmup: int, matmul_dtype: str,
                 unroll_layers: bool = False, loss_chunks: int = 1, xla_options: str = "",
                 overrides: Sequence[str] = ()) -> dict:
    import jax

    from jaxpar.data.sources import make_source
    from jaxpar.train import build

    config = jaxpar_config(shape, batch, seq, remat, steps + warmup, matmul_dtype, loss_chunks, unroll_layers, xla_options,
                           overrides)
    trainer = build(config, jax.devices()[:1])
    step = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    state, source = trainer.init(), make_source(trainer.batch, trainer.config)
    batches = [source(i) for i in range(2)]
    times, loss = [], None
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batches[i % 2])
        loss = float(metrics["loss"])  # waits for the step
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "loss": loss, "params": config.model.param_count(),
            "flops_per_step": config.model.flops_per_token(seq) * batch * seq, "device": jax.devices()[0].device_kind}


def torch_steps(shape: dict, batch: int, seq: int, steps: int, warmup: int, checkpointing: bool = False) -> dict:
    """The peer's median step; `checkpointing`: Hugging Face's per-layer activation
    checkpointing (jaxpar's remat full, its counterpart; the peer has no finer policy)."""
    try:
        import torch
        from transformers import LlamaConfig as HFConfig
        from transformers import LlamaForCausalLM
    except ImportError as e:
        return {"skipped": f"not installed: {e.name}"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = HFConfig(vocab_size=shape["vocab_size"], hidden_size=shape["embed"], intermediate_size=shape["mlp"],
                      num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                      num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                      max_position_embeddings=seq, rms_norm_eps=1e-6,
                      tie_word_embeddings=shape.get("tie_embeddings", False),
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")
    compiled = torch.compile(model)
    ids = torch.randint(0, shape["vocab_size"], (2, batch, seq), device=device)

    def step(tokens):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    times, loss = [], None
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = float(step(ids[i % 2]))  # .item() waits for the step
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "loss": loss, "params": sum(p.numel() for p in model.parameters()),
            "torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}


def compile_only(args) -> int:
    """jaxpar's step compiled by XLA's GPU compiler for the GPU a target config describes."""
    import re

    from jaxpar.deviceless import gpu_devices

    device = gpu_devices(args.target)[0]
    import jax

    from jaxpar.flops import peak_flops
    from jaxpar.inspect.hlo import dot_types
    from jaxpar.inspect.report import temporary_findings
    from jaxpar.train import build

    hbm = int(re.search(r"device_memory_size:\s*(\d+)", pathlib.Path(args.target).read_text()).group(1))
    shape = {**SHAPES[args.shape], **({"vocab_size": args.vocab} if args.vocab else {})}
    config = jaxpar_config(shape, args.batch, args.seq_len, args.remat, 1, args.matmul_dtype, args.loss_chunks,
                           args.unroll_layers, args.xla_options, args.overrides)
    trainer = build(config, [device])
    compiled = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    memory = compiled.memory_analysis()
    used = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + memory.temp_size_in_bytes
    text = compiled.as_text()
    kernels = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    gemms = dot_types(text)  # every dot, inside fusions too, and cuBLAS calls: by the types their multiply reads
    oversized = [str(f) for f in temporary_findings(trainer, text)]  # explain's findings, for this GPU's program
    flops = config.model.flops_per_token(args.seq_len) * args.batch * args.seq_len
    peak = peak_flops(device)
    row = {"device": device.device_kind, "attention": trainer.layout.attention, "argument_bytes": memory.argument_size_in_bytes,
           "temp_bytes": memory.temp_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
           "alias_bytes": memory.alias_size_in_bytes, "hbm_bytes": hbm, "custom_calls": kernels, "gemms": gemms,
           "oversized_temporaries": oversized,
           "model_flops_per_step": flops, "step_s_at_50_percent_mfu": flops / (0.5 * peak) if peak else None}
    print(f"jaxpar step, Llama {config.model.param_count() / 1e9:.2f}B, batch {args.batch} x seq {args.seq_len}, bf16, "
          f"remat {args.remat}, vocab {shape['vocab_size']}, loss in {args.loss_chunks} chunk(s): compiled "
          f"(deviceless) for one {device.device_kind}")
    print(f"  memory   {used / 2**30:.1f} GiB of {hbm / 2**30:.1f} GiB (arguments {memory.argument_size_in_bytes / 2**30:.1f}, "
          f"temporaries {memory.temp_size_in_bytes / 2**30:.1f}, outputs {memory.output_size_in_bytes / 2**30:.1f}, "
          f"aliased {memory.alias_size_in_bytes / 2**30:.1f})")
    print(f"  attention {trainer.layout.attention}; library calls: {', '.join(kernels) or 'none'}")
    print(f"  GEMMs by operand types: {', '.join(f'{k}: {v}' for k, v in sorted(gemms.items()))}")
    print("  parameter-shaped temporaries larger than a layer:" + "".join(f"\n    {f}" for f in oversized) if oversized
          else "  parameter-shaped temporaries larger than a layer: none")
    if peak:
        print(f"  {flops / 1e12:.1f} model TFLOP per step: 50% MFU is {flops / (0.5 * peak) * 1e3:.0f} ms a step "
              f"({args.batch * args.seq_len / (flops / (0.5 * peak)):,.0f} tokens/s)")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"compile_only": row, "shape": shape, "batch": args.batch, "seq_len": args.seq_len,
                               "remat": args.remat, "matmul_dtype": args.matmul_dtype, "loss_chunks": args.loss_chunks,
                               "overrides": args.overrides,
                               "jax": jax.__version__}, indent=1))
    print(f"wrote {out}")
    return 0 if used <= hbm else 1


def run_side(side: str) -> dict:
    """One side's row, measured in a child process of its own (it alone holds the GPU)."""
    import subprocess

    child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", side], capture_output=True, text=True)
    rows = [line[5:] for line in child.stdout.splitlines() if line.startswith("SIDE ")]
    if child.returncode or not rows:
        tail = (child.stderr or child.stdout).strip().splitlines()[-3:]
        return {"skipped": f"{side} exited {child.returncode}: " + " | ".join(tail)}
    return json.loads(rows[-1])


def main() -> int:
    args = parse_args()
    if args.target and args.tiny:
        raise SystemExit("--target compiles a real shape for a GPU; --tiny is for CPU runs, drop one")
    if not args.target and args.vocab:
        raise SystemExit("--vocab changes the compiled shape only: give --target too")
    if args.tiny and args.shape != "0.9b":
        raise SystemExit(f"--tiny is its own toy shape; drop --shape {args.shape}")
    refuse_flagged(args.overrides)
    from jaxpar.device_memory import share_gpu_memory

    share_gpu_memory()  # as jaxpar's commands do: the planner's 90%, not JAX's 75%
    args.out = args.out or f"benchmarks/results/{'mfu_compile' if args.target else 'mfu'}.json"
    if args.target:
        return compile_only(args)
    import jax

    from jaxpar.flops import peak_flops

    shape = TINY if args.tiny else SHAPES[args.shape]
    batch, seq = (2, 64) if args.tiny else (args.batch, args.seq_len)
    if args.side:
        row = (jaxpar_steps(shape, batch, seq, args.remat, args.steps, args.warmup, args.matmul_dtype, args.unroll_layers,
                            args.loss_chunks, args.xla_options, args.overrides)
               if args.side == "jaxpar" else torch_steps(shape, batch, seq, args.steps, args.warmup, args.remat != "none"))
        print("SIDE " + json.dumps(row))
        return 0
    tokens = batch * seq
    ours = run_side("jaxpar")
    peer = {"skipped": "--no-peer"} if args.no_peer else run_side("pytorch")
    if "step_s" not in ours:
        raise SystemExit(f"jaxpar's side failed: {ours['skipped']}")
    peak = peak_flops(SimpleNamespace(device_kind=ours["device"]))  # the parent never touches the GPU
    rows = {"jaxpar": ours, "pytorch": peer}
    for name, row in rows.items():
        if "step_s" in row:
            row["tokens_per_s"] = tokens / row["step_s"]
            row["mfu"] = ours["flops_per_step"] / row["step_s"] / peak if peak else None
    dtype = "bf16" if args.matmul_dtype == "compute" else "bf16 with fp8 matmuls (jaxpar)"
    print(f"Llama {ours['params'] / 1e9:.2f}B params, batch {batch} x seq {seq}, {dtype}, one {ours['device']} "
          f"(peak {peak / 1e12:.0f} TFLOP/s)" if peak else f"Llama {ours['params'] / 1e6:.1f}M params on {ours['device']} (no known peak)")
    print(f"{'':8s} {'step':>9s} {'tokens/s':>10s} {'MFU':>7s} {'loss':>8s}")
    for name, row in rows.items():
        if "skipped" in row:
            print(f"{name:8s} skipped: {row['skipped']}")
            continue
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        print(f"{name:8s} {row['step_s'] * 1e3:7.1f}ms {row['tokens_per_s']:10,.0f} {mfu:>7s} {row['loss']:8.4f}")
    if "tokens_per_s" in peer:
        print(f"jaxpar / pytorch tokens/s: {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": shape, "batch": batch, "seq_len": seq, "remat": args.remat,
                               "unroll_layers": args.unroll_layers, "loss_chunks": args.loss_chunks,
                               "xla_options": args.xla_options, "overrides": args.overrides,
                               "matmul_dtype": args.matmul_dtype, "jax": jax.__version__,
                               "python": platform.python_version(), "peak_flops": peak, **rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
