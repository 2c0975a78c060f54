"""`jaxpar sample CHECKPOINT --prompt TEXT`: continue a prompt with a trained checkpoint, on a
mesh of this machine's devices (jaxpar.generate.sample: with a key/value cache where the layout
allows it, `--no-kv-cache` to run the whole sequence again for every token).

The checkpoint directory alone describes the run (jaxpar.loop.checkpoint.saved_config);
`--set` changes its config as `jaxpar train` does (naming any mesh.* axis replaces the saved
mesh). `hf:FOLDER` samples a Hugging Face checkpoint's weights as published, its config
that of the recipe hf:FOLDER. The tokenizer is a Hugging Face tokenizer.json: --tokenizer,
else the run's data.tokenizer. Device set-up comes first: JAX reads the CPU device count
once, when its backends start.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib

from jaxpar.commands.common import (
    add_cpu_devices,
    add_overrides,
    check_cpu_devices,
    distributed_settings,
    hf_checkpoint,
    in_cluster,
    recorded_file,
    recorded_in,
    restore,
)
from jaxpar.errors import ConfigError
from jaxpar.mesh import BATCH_AXES
from jaxpar.model import declared

BATCH = 8  # --file's prompts continued at once, unless --batch says


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `sample` on the CLI's subparsers."""
    parser = subparsers.add_parser("sample", help="continue a prompt with a trained checkpoint")
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a run's checkpoint.dir, or hf:FOLDER for a Hugging Face checkpoint's weights as published")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    given.add_argument("--file", metavar="PROMPTS.jsonl",
                       help='many prompts, a JSON object a line with its "prompt"; answered in batches, one JSON line '
                            'each ({"prompt", "completion", "tokens", "stopped"}) to --out or stdout')
    parser.add_argument("--out", metavar="FILE", help="with --file: where the answers go (default: stdout)")
    parser.add_argument("--batch", type=int, metavar="N",
                        help=f"with --file: prompts continued at once, a row each (default {BATCH})")
    parser.add_argument("--chat", action="store_true",
                        help="each prompt is a user's message, rendered with the chat template (the run's "
                             "data.chat_template, else the tokenizer's own) and its generation prompt; the answer "
                             "stops at the template's end of turn too")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a Hugging Face tokenizer.json (default: the run's data.tokenizer)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to add (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 (default): greedy; above 0: draw from softmax(logits / T)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="draw only among the K likeliest tokens (default 0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="draw only among the likeliest tokens whose probabilities sum to P (default 1: all)")
    parser.add_argument("--seed", type=int, default=0, help="the random draws' seed (default 0)")
    parser.add_argument("--no-kv-cache", dest="kv_cache", action="store_false", default=None,
                        help="run the whole sequence again for every new token instead of reading a key/value cache "
                             "(the cache is used wherever the layout allows it: not under mesh.context > 1)")
    parser.add_argument("--step", type=int, metavar="STEP", help="the checkpoint step (default: the newest)")
    add_overrides(parser, "mesh.tensor=4")
    add_cpu_devices(parser)
    return parser


def run(args) -> int:
    """Check the arguments, then sample: alone, or as one of several processes (jaxpar launch
    --nproc N -- sample ...: every one restores its shards and runs each step, process 0
    prints)."""
    texts = _check_arguments(args)
    from jaxpar.mesh import force_cpu_devices

    force_cpu_devices(args.cpu_devices)  # only the CPU backend reads it; accelerators win if present
    from jaxpar.config import Config

    return in_cluster(lambda: _sample(args, texts), lambda: distributed_settings(Config(), args.overrides))


def _sample(args, texts: list[str]) -> int:
    """Rebuild the run's config, restore its weights (or read hf:FOLDER's) on the mesh, and
    print the mesh, then the prompt and its continuation."""
    import jax

    from jaxpar import recipes
    from jaxpar.config import with_overrides
    from jaxpar.mesh import describe
    from jaxpar.step.trainer import build
    from jaxpar.loop.checkpoint import saved_config

    devices = jax.devices()
    published = args.checkpoint.startswith("hf:")
    recorded = recipes.load(args.checkpoint) if published else saved_config(args.checkpoint, args.step)
    run_config = with_overrides(recorded, args.overrides, len(devices))
    if run_config.model.task != "lm":
        raise ConfigError(f"CHECKPOINT={args.checkpoint!r} holds a {type(run_config.model).__name__} with model.task="
                          f"{run_config.model.task!r}; sample continues text with a language model (model.task='lm')")
    tokenizer = _load_tokenizer(args, run_config.data, declared(run_config.model, "vocab_size"))
    where = [f"--prompt={text!r}" if args.file is None else f"--file={args.file!r}: {text!r}" for text in texts]
    template = None
    if args.chat:  # the template writes its own begin-of-text
        from jaxpar.data.chat import template_for

        template = template_for(args.tokenizer or run_config.data.tokenizer, run_config.data.chat_template)
        ids, begin = _chat_prompts(texts, where, tokenizer, template), []
    else:
        ids = [_encode(tokenizer, text, w) for text, w in zip(texts, where)]
        begin = [run_config.data.bos_id] if run_config.data.bos_id >= 0 else []  # as training put it before each document
    config = sampling_config(run_config, len(devices), len(begin) + max(map(len, ids)) + args.max_new_tokens)
    trainer = build(config, devices)
    params, which = _published_weights(trainer, run_config) if published else _run_weights(trainer, args)
    stops = _stop_ids(args, run_config, tokenizer, template)
    drawn = _continue(trainer, params, [begin + i for i in ids], args, stops,
                      tokenizer.get_vocab_size(with_added_tokens=True))
    from jaxpar.generate.sample import uses_kv_cache

    how = "greedy" if args.temperature == 0 else (
        f"temperature {args.temperature}, top-k {args.top_k or 'all'}, top-p {args.top_p:g}, seed {args.seed}")
    how += ", kv cache" if uses_kv_cache(trainer, args.kv_cache) else ", no kv cache"
    counted = f"{len(drawn[0])} tokens" if args.file is None else f"{len(drawn)} prompts, {sum(map(len, drawn))} tokens"
    header = (f"{args.checkpoint} {which}: {type(config.model).__name__} | mesh {describe(trainer.layout.mesh)} on "
              f"{len(devices)} {devices[0].platform} devices | {counted}, {how}")
    if jax.process_index() != 0:  # every process drew the same tokens; one prints or writes them
        return 0
    if args.file is None:
        print(header, flush=True)
        print(args.prompt + _completion(tokenizer, ids[0], drawn[0]), flush=True)
    else:
        _write_answers(args, header, [{"prompt": text, "completion": _completion(tokenizer, i, d), "tokens": len(d),
                                       "stopped": d[-1] in stops} for text, i, d in zip(texts, ids, drawn)])
    return 0


def _stop_ids(args, run_config, tokenizer, template) -> list[int]:
    """Where each answer stops (jaxpar.hf.generation.stop_ids): the run's data.eos_id, with
    --chat its template's end of turn, and the ids the checkpoint it started from lists
    (generation_config.json) where the tokenizer is that checkpoint's."""
    from jaxpar.data.chat import end_of_turn_id
    from jaxpar.hf.generation import stop_ids

    end_of_turn = end_of_turn_id(tokenizer, template) if template is not None else None
    return stop_ids(run_config.data.eos_id, run_config.checkpoint.init_from,
                    args.tokenizer or run_config.data.tokenizer, end_of_turn)


def _continue(trainer, params, prompts: list[list[int]], args, stops: list[int], vocab: int) -> list[list[int]]:
    """Each prompt's drawn tokens, --batch prompts at a time in one buffer length (one compile)."""
    from tqdm import tqdm

    from jaxpar.generate.sample import generate_batch

    size = args.batch or BATCH
    out, batches = [], range(0, len(prompts), size)
    for start in tqdm(batches, unit="batch", disable=len(batches) == 1 or None, dynamic_ncols=True):
        out += generate_batch(trainer, params, prompts[start:start + size], args.max_new_tokens, args.temperature,
                              args.top_k, args.seed, stop_ids=stops, vocab_limit=vocab, length=trainer.config.train.seq_len,
                              top_p=args.top_p, kv_cache=args.kv_cache)
    return out


def _write_answers(args, header: str, answers: list[dict]) -> None:
    """One JSON line an answer to --out (written whole, then renamed into place) or stdout;
    the header to stdout, or stderr where stdout carries the answers."""
    import json
    import os
    import sys

    lines = "".join(json.dumps(a, ensure_ascii=False) + "\n" for a in answers)
    if args.out is None:
        print(header, file=sys.stderr, flush=True)
        sys.stdout.write(lines)
        sys.stdout.flush()
        return
    out = pathlib.Path(args.out)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(lines)
    os.replace(partial, out)
    print(f"{header}\nwrote {len(answers)} answers to {out}", flush=True)


def _run_weights(trainer, args) -> tuple:
    """(params, 'step N'): the run's checkpoint at --step, else its newest, restored onto the trainer."""
    state, step = restore(trainer, args.checkpoint, args.step)
    return trainer.weights(state), f"step {step}"


def _published_weights(trainer, run_config) -> tuple:
    """(params, 'as published'): a Hugging Face checkpoint's weights (the recipe hf:FOLDER's
    checkpoint.init_from), read straight onto the trainer's mesh."""
    from jaxpar.hf import prepare_import

    return trainer.weights(prepare_import(trainer, run_config.checkpoint.init_from)()), "as published"


def sampling_config(config, num_devices: int, tokens: int):
    """`config` for a forward pass: one batch of the fewest rows its mesh splits and a
    sequence of `tokens` rounded up to what the mesh splits; no data or checkpoint settings
    (nothing is trained or saved) but where the weights started (a LoRA run's frozen base is
    read from there)."""
    from jaxpar.config import CheckpointConfig, DataConfig
    from jaxpar.generate.sample import sequence_multiple

    sizes = config.mesh.resolve(num_devices)
    multiple = sequence_multiple(sizes, config.parallel.context.layout, config.parallel.tensor.sequence_parallel)
    rows = math.prod(sizes[a] for a in BATCH_AXES) * config.train.microbatches
    train = dataclasses.replace(config.train, seq_len=-(-tokens // multiple) * multiple, global_batch=rows)
    return dataclasses.replace(config, train=train, data=DataConfig(),
                               checkpoint=CheckpointConfig(init_from=config.checkpoint.init_from))


def _check_arguments(args) -> list[str]:
    """Everything that needs no JAX, before devices start; returns the prompts."""
    if args.prompt is not None and not args.prompt:
        raise ConfigError("--prompt='' is empty; give text to continue, e.g. --prompt 'Once upon a time'")
    if args.file is None and (args.out is not None or args.batch is not None):
        raise ConfigError(f"{'--out' if args.out is not None else '--batch'} applies to --file's prompts; with --prompt "
                          "the continuation is printed")
    if args.batch is not None and args.batch < 1:
        raise ConfigError(f"--batch={args.batch}; give at least 1 prompt a batch, e.g. --batch 8")
    if args.out is not None and not pathlib.Path(args.out).parent.is_dir():
        raise ConfigError(f"--out={args.out!r}: its folder {str(pathlib.Path(args.out).parent)!r} does not exist")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature={args.temperature}; use 0 for greedy, or a positive value such as 0.8")
    if args.top_k < 0:
        raise ConfigError(f"--top-k={args.top_k}; use 0 for the whole vocabulary, or a positive count such as 40")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p={args.top_p}; use 1 for the whole vocabulary, or a probability mass such as 0.9")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens}; give at least 1")
    check_cpu_devices(args)

    folder = hf_checkpoint(args.checkpoint)
    if args.checkpoint.startswith("hf:"):
        if args.step is not None:
            raise ConfigError(f"--step={args.step} picks a step of a run's checkpoint.dir, but CHECKPOINT="
                              f"{args.checkpoint!r} is a Hugging Face checkpoint, one set of weights; leave --step out")
    elif folder is not None:
        raise ConfigError(f"CHECKPOINT={args.checkpoint!r} is a Hugging Face checkpoint (config.json and safetensors "
                          f"files), not a jaxpar run's checkpoint.dir; sample its weights as they are with jaxpar "
                          f"sample hf:{folder} ..., or fine-tune it with jaxpar train hf:{folder} --set "
                          "checkpoint.dir=DIR ... and sample DIR")
    elif not pathlib.Path(args.checkpoint).is_dir():
        raise ConfigError(f"CHECKPOINT={args.checkpoint!r} is not a directory; give the checkpoint.dir of a run that "
                          "saved checkpoints, or hf:FOLDER for a Hugging Face checkpoint")
    return [args.prompt] if args.file is None else read_prompts(args.file)


def read_prompts(path: str) -> list[str]:
    """The "prompt" of each line of a JSONL file; a line that is not one is refused, naming it."""
    import json

    from jaxpar.data.text import json_error

    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"--file={path!r} is not a file; give a JSONL file, one {{\"prompt\": TEXT}} a line")
    prompts = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--file={path!r} line {n} is not JSON ({json_error(e)}); give one {{\"prompt\": TEXT}} a "
                              "line") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise ConfigError(f"--file={path!r} line {n} has no \"prompt\" text; give one {{\"prompt\": TEXT}} a line")
        prompts.append(record["prompt"])
    if not prompts:
        raise ConfigError(f"--file={path!r} holds no prompts; give one {{\"prompt\": TEXT}} a line")
    return prompts


def _load_tokenizer(args, data, model_vocab: int | None):
    """--tokenizer, else the run's data.tokenizer, loaded as training loads it
    (jaxpar.data.text: truncation and padding off, data.eos_id one of its ids); its
    vocabulary may not exceed the model's."""
    from jaxpar.data.text import CONFIG_NAMES, TextSpec, load_tokenizer

    given = args.tokenizer
    if given is None and not data.tokenizer:
        raise ConfigError("--tokenizer is not given and the checkpoint's data.tokenizer is empty; give --tokenizer "
                          "PATH to the tokenizer.json the model was trained with")
    if given is None:
        recorded_file(data.tokenizer, "data.tokenizer", recorded_in(args, "data.tokenizer"), "--tokenizer PATH")
    name = "--tokenizer" if given is not None else "data.tokenizer"
    path = given if given is not None else data.tokenizer
    tokenizer = load_tokenizer(TextSpec("", path, eos_id=data.eos_id, names=CONFIG_NAMES._replace(tokenizer=name),
                                        bos_id=data.bos_id))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if model_vocab is not None and vocab > model_vocab:
        raise ConfigError(f"{name}={path!r} has {vocab} tokens, more than the checkpoint's model.vocab_size="
                          f"{model_vocab}; give the tokenizer the model was trained with (ids below {model_vocab})")
    return tokenizer


def _chat_prompts(texts: list[str], where: list[str], tokenizer, template) -> list[list[int]]:
    """Each text as a user's message, rendered with the chat template and its generation
    prompt, tokenized as training tokenizes conversations (jaxpar.data.chat)."""
    ids = []
    for text, w in zip(texts, where):
        rendered = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
        ids.append(_encode(tokenizer, rendered, w))
    return ids


def _encode(tokenizer, prompt: str, where: str) -> list[int]:
    """The prompt's ids as training encodes a document's text: no special tokens added (the run's
    data.bos_id goes before them, as before each document)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise ConfigError(f"{where} encodes to no tokens with this tokenizer; give text it has tokens for")
    return ids


def _completion(tokenizer, prompt_ids: list[int], drawn: list[int]) -> str:
    """The drawn tokens' text as it follows the prompt: decoded together with the prompt where
    that starts with the prompt's own text (a lone token may lose its leading space)."""
    prompt, whole = tokenizer.decode(prompt_ids), tokenizer.decode(prompt_ids + drawn)
    return whole[len(prompt):] if whole.startswith(prompt) else tokenizer.decode(drawn)
