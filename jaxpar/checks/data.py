"""The data section: where batches come from, packed documents, and the held-out part of a token file."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError

RULES: list[Rule] = []
rule = collector(RULES)

# data.source -> what its data.path names, for those that read one
FILE_SOURCES = {
    "tokens": "a .npy or .bin file of token ids",
    "text": "a .txt, .jsonl or .parquet file, a folder of them, or a glob",
    "chat": "a .jsonl or .parquet file of conversations, a folder of them, or a glob",
    "preference": "a .jsonl or .parquet file of {prompt, chosen, rejected} records, a folder of them, or a glob",
}


@rule(
    "file-data-needs-language-model",
    fields=["data.source", "model"],
    summary="A token file or text feeds a language model (model.task=lm).",
    example=["data.source=tokens", "data.path=tokens.npy"],
    base="mlp",
)
def file_data_needs_language_model(config, sizes) -> None:
    source = config.data.source
    if source in FILE_SOURCES and config.model.task != "lm":  # else the synthetic classes would train, silently
        raise ConfigError(f"data.source={source} holds tokens for a language model, but model.task="
                          f"{config.model.task!r}; use data.source=synthetic, or give your batches to "
                          "jaxpar.train.run(trainer, data=...)")


@rule(
    "tokens-need-path",
    fields=["data.source", "data.path"],
    summary="data.source=tokens or text reads what data.path names; data.path needs one of them.",
    example=["data.source=tokens"],
    also=[["data.path=tokens.npy"], ["data.source=text", "data.tokenizer=tokenizer.json"]],
)
def tokens_need_path(config, sizes) -> None:
    source, path = config.data.source, config.data.path
    if source in FILE_SOURCES and not path:
        raise ConfigError(f"data.source={source} needs data.path, {FILE_SOURCES[source]}")
    if source not in FILE_SOURCES and path:  # else the file would be ignored, silently
        sources = ", ".join(list(FILE_SOURCES)[:-1]) + f" or {list(FILE_SOURCES)[-1]}"
        raise ConfigError(f"data.path={path!r} is read only with data.source={sources}, but data.source={source!r}; "
                          f"set data.source to one of them (tokens: token ids), or drop data.path")


@rule(
    "mix-recipe",
    fields=["data.source", "data.mix", "data.mix_schedule", "data.tokenizer", "train.steps", "model"],
    summary="data.source=mix reads data.mix, two or more \"WEIGHT KIND:PATH\" sources (tokens, text, chat, "
    "synthetic) whose weights are >= 0 and sum to 1, for a language model; data.mix_schedule's changes go up "
    "inside train.steps with as many weights; text and chat need data.tokenizer; data.mix is read only then.",
    example=["data.source=mix", "data.mix=0.7 synthetic, 0.2 synthetic"],
    also=[["data.mix=0.5 synthetic, 0.5 synthetic"], ["data.source=mix"],
          ["data.source=mix", "data.mix=0.5 text:a.txt, 0.5 synthetic"],
          ["data.source=mix", "data.mix=0.5 tokens:a.npy, 0.5 synthetic", "data.mix_schedule=5=0.5,0.5"],
          ["data.source=mix", "data.mix=0.5 tokens:a.npy, 0.5 synthetic", "data.mix_schedule=anneal 2=1,0,0"]],
)
def mix_recipe(config, sizes) -> None:
    data = config.data
    if data.source != "mix":
        if data.mix or data.mix_schedule:  # else they would be ignored, silently
            raise ConfigError(f"data.mix={data.mix!r} is read only with data.source=mix, but data.source="
                              f"{data.source!r}; set data.source=mix, or drop data.mix and data.mix_schedule")
        return
    if not data.mix:
        raise ConfigError("data.source=mix needs data.mix, e.g. data.mix=\"0.7 text:web.txt, 0.3 tokens:code.bin\"")
    from jaxpar.data.mixing import parse_mix, parse_schedule

    entries = parse_mix(data.mix)
    parse_schedule(data.mix_schedule, tuple(e.weight for e in entries), config.train.steps)
    if config.model.task != "lm":
        raise ConfigError(f"data.source=mix mixes token sources for a language model, but model.task="
                          f"{config.model.task!r}; use data.source=synthetic")
    needs = [e for e in entries if e.kind in ("text", "chat")]
    if needs and not data.tokenizer:
        raise ConfigError(f"data.mix's {needs[0].kind} source {needs[0].path!r} needs data.tokenizer, a Hugging Face "
                          "tokenizer.json, which every source of the mixture shares")


@rule(
    "text-workers-and-cache",
    fields=["data.workers", "data.cache", "data.source"],
    summary="data.workers (>= 0) and data.cache tokenize a text corpus (data.source=text, or a mixture's text); "
    "data.cache is a folder this user can write.",
    example=["data.workers=-1"],
    also=[["data.cache=/tmp"], ["data.source=text", "data.path=a.txt", "data.tokenizer=t.json",
                                "data.cache=/proc/no_such_folder"]],
)
def text_workers_and_cache(config, sizes) -> None:
    import os

    from jaxpar.data.mixing import parse_mix  # mix-recipe, earlier, has checked data.mix parses

    data = config.data
    if data.workers < 0:
        raise ConfigError(f"data.workers={data.workers}; use 0 (this process) or the processes to tokenize with, e.g. "
                          f"data.workers={os.cpu_count() or 1}")
    texts = data.source == "text" or (data.source == "mix" and any(e.kind == "text" for e in parse_mix(data.mix)))
    if (data.cache or data.workers) and not texts:  # else they would be ignored, silently
        field = "data.cache" if data.cache else "data.workers"
        raise ConfigError(f"{field} tokenizes a text corpus, but data.source={data.source!r} has none; set "
                          "data.source=text (or a text source in data.mix), or drop it")
    if data.cache and not (os.path.isdir(data.cache) and os.access(data.cache, os.W_OK | os.X_OK)):
        raise ConfigError(f"data.cache={data.cache!r} is not a folder this user can write; create it first "
                          f"(mkdir -p {data.cache}), or give another")


@rule(
    "text-needs-tokenizer",
    fields=["data.source", "data.tokenizer"],
    summary="data.source=text or chat is tokenized with data.tokenizer, a tokenizer.json (which `jaxpar sample` "
    "and `jaxpar export` also read, with any source).",
    example=["data.source=text", "data.path=corpus.jsonl"],
    also=[["data.source=chat", "data.path=chats.jsonl"]],
)
def text_needs_tokenizer(config, sizes) -> None:
    if config.data.source in ("text", "chat", "preference") and not config.data.tokenizer:
        raise ConfigError(f"data.source={config.data.source} needs data.tokenizer, a Hugging Face tokenizer.json "
                          "(the one beside the model's weights)")


@rule(
    "text-field-named",
    fields=["data.text_field"],
    summary="data.text_field names the JSONL key or Parquet column that holds each document.",
    example=["data.text_field="],
)
def text_field_named(config, sizes) -> None:
    if not config.data.text_field:
        raise ConfigError("data.text_field='' names no key; set it to the JSONL key or Parquet column that holds "
                          "each document's text, e.g. data.text_field=text")


@rule(
    "chat-settings-need-chat",
    fields=["data.chat_template", "data.messages_field", "data.source"],
    summary="data.chat_template is read with data.source=chat or preference, data.messages_field with chat; the "
    "field names a key.",
    example=["data.chat_template=template.jinja"],
    also=[["data.source=chat", "data.path=chats.jsonl", "data.tokenizer=tokenizer.json", "data.messages_field="]],
)
def chat_settings_need_chat(config, sizes) -> None:
    data = config.data
    if data.source not in ("chat", "preference") and data.chat_template:  # else the template would be ignored, silently
        raise ConfigError(f"data.chat_template={data.chat_template!r} renders conversations, read only with "
                          f"data.source=chat or preference, but data.source={data.source!r}; set data.source=chat, or "
                          "drop it")
    if data.source != "chat" and data.messages_field != "messages":
        raise ConfigError(f"data.messages_field={data.messages_field!r} names conversations, read only with "
                          f"data.source=chat, but data.source={data.source!r}; set data.source=chat, or drop it")
    if not data.messages_field:
        raise ConfigError("data.messages_field='' names no key; set it to the JSONL key or Parquet column that holds "
                          "each conversation, e.g. data.messages_field=messages")


@rule(
    "dpo-beta-positive",
    fields=["train.dpo_beta"],
    summary="DPO's beta scales the policy's log-ratios to the reference: a positive number (0.1 is usual).",
    example=["train.dpo_beta=0"],
)
def dpo_beta_positive(config, sizes) -> None:
    if not config.train.dpo_beta > 0:
        raise ConfigError(f"train.dpo_beta={config.train.dpo_beta} must be positive (0.1 is usual); it scales the "
                          "log-ratios of the policy to the reference in the DPO loss")


@rule(
    "data-order",
    fields=["data.order", "data.source"],
    summary="data.order=epochs goes through a token file or text once per epoch, so it needs one (windows, at "
    "random positions, suit any source).",
    example=["data.order=epochs"],
)
def data_order(config, sizes) -> None:
    order, source = config.data.order, config.data.source
    if order == "epochs" and source not in (*FILE_SOURCES, "mix"):  # a synthetic stream has no rows to go through
        raise ConfigError(f"data.order=epochs goes through a token file or text once per epoch, but "
                          f"data.source={source!r} is endless; set data.source=tokens or text, or data.order=windows")


@rule(
    "eos-needs-language-model",
    fields=["data.eos_id", "model"],
    summary="Packed documents (data.eos_id) are for language models only.",
    example=["data.eos_id=0"],
    base="mlp",
)
def eos_needs_language_model(config, sizes) -> None:
    eos = config.data.eos_id
    if eos != -1 and config.model.task != "lm":
        raise ConfigError(
            f"data.eos_id={eos} packs documents of a language model, but model.task={config.model.task!r}; use -1"
        )


@rule(
    "eos-in-vocabulary",
    fields=["data.eos_id", "model.vocab_size"],
    summary="data.eos_id is a token id of the model's vocabulary, or -1 for unpacked rows.",
    example=["data.eos_id=128"],
)
def eos_in_vocabulary(config, sizes) -> None:
    _token_in_vocabulary(config, "eos_id", "unpacked rows")


def _token_in_vocabulary(config, field: str, minus_one: str) -> None:
    """data.<field> is a token id of the model's vocabulary or -1 (`minus_one` says what that means)."""
    value = getattr(config.data, field)
    if value != -1 and not 0 <= value < config.model.vocab_size:
        raise ConfigError(f"data.{field}={value} must be a token id (0 to model.vocab_size - 1 = "
                          f"{config.model.vocab_size - 1}), or -1 for {minus_one}")


@rule(
    "bos-in-vocabulary",
    fields=["data.bos_id", "model.vocab_size"],
    summary="data.bos_id (put before each text document and each sampled prompt) is a token id of the model's "
    "vocabulary, or -1 for none.",
    example=["data.bos_id=128"],
)
def bos_in_vocabulary(config, sizes) -> None:
    _token_in_vocabulary(config, "bos_id", "none")


@rule(
    "eval-fraction-range",
    fields=["data.eval_fraction"],
    summary="The held-out share of a token file is a fraction below 1, or 0 for none.",
    example=["data.eval_fraction=1.5"],
    also=[["data.eval_fraction=-0.1"]],
)
def eval_fraction_range(config, sizes) -> None:
    fraction = config.data.eval_fraction
    if not 0 <= fraction < 1:
        raise ConfigError(
            f"data.eval_fraction={fraction} must be in (0, 1), the share of the token file held out "
            "(e.g. 0.01: its last 1%), or 0 to train on all of it"
        )


@rule(
    "eval-fraction-needs-token-file",
    fields=["data.eval_fraction", "data.source"],
    summary="data.eval_fraction splits a token file or text; synthetic sources hold out a random stream of their own.",
    example=["data.eval_fraction=0.1"],
)
def eval_fraction_needs_token_file(config, sizes) -> None:
    fraction = config.data.eval_fraction
    if fraction and config.data.source == "preference":
        raise ConfigError(f"data.eval_fraction={fraction}: preference pairs have no held-out part yet; leave "
                          "data.eval_fraction=0 (and train.eval_every=0)")
    if fraction and (config.data.source not in (*FILE_SOURCES, "mix") or config.model.task != "lm"):
        raise ConfigError(
            f"data.eval_fraction={fraction} holds out the end of a token file or text, but data.source="
            f"{config.data.source} (model.task={config.model.task!r}) draws held-out batches from a random stream "
            "of its own; leave data.eval_fraction=0, or set data.source=tokens or text"
        )


@rule(
    "token-eval-needs-held-out-part",
    fields=["train.eval_every", "data.eval_fraction"],
    summary="Evaluating a model trained on a token file or text needs a held-out part of it, data.eval_fraction > 0.",
    example=["train.eval_every=10", "data.source=tokens", "data.path=tokens.npy"],
    also=[["train.eval_every=10", "data.source=text", "data.path=corpus.jsonl", "data.tokenizer=tokenizer.json"]],
)
def token_eval_needs_held_out_part(config, sizes) -> None:
    every, data = config.train.eval_every, config.data
    if every and data.source in FILE_SOURCES and config.model.task == "lm" and not data.eval_fraction:
        raise ConfigError(
            f"train.eval_every={every} evaluates on held-out batches, but data.eval_fraction=0 holds none of "
            f"data.path={data.path!r} out of training; set data.eval_fraction=0.01 (its last 1%)"
        )
