"""Where generation stops: the end-of-text and end-of-turn ids a run knows, and the
generation_config.json its export writes.

A Hugging Face checkpoint names its end of text in config.json (`eos_token_id`) and the ids
generation stops at in generation_config.json (`eos_token_id`: an id or a list; Qwen3's
lists <|im_end|> beside <|endoftext|>). A jaxpar run knows three kinds:

  * data.eos_id, the end of text it trained with (every document ended with it);
  * the chat template's end of turn (jaxpar.data.chat.end_of_turn_id), where a chat
    model's answer stops: ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>;
  * the ids the checkpoint it started from (checkpoint.init_from) lists, which name the same
    tokens only where the run reads that checkpoint's own tokenizer: they are kept then, and
    only then.

`jaxpar sample` stops at all of them (the end of turn with --chat), and an export's
generation_config.json lists them, the run's data.eos_id first, so that transformers, vLLM and
`jaxpar sample hf:EXPORT` stop where the run's model learned to.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jaxpar.errors import ConfigError

GENERATION_FILE = "generation_config.json"
# Keys of a base generation_config.json an export does not carry over: transformers writes
# them itself, and `_from_model_config` would let config.json's values replace the file's.
DROPPED = ("_from_model_config", "transformers_version")


def listed_ids(value: Any) -> list[int]:
    """An `eos_token_id` as a list: an id, a list of ids, or none (null, absent)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def read_json(path: pathlib.Path) -> dict:
    """A JSON object file's keys ({} where there is no file); a damaged one is refused naming it."""
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{str(path)!r} is not readable JSON ({type(e).__name__}: {e}); repair or remove it") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{str(path)!r} holds a JSON {type(values).__name__}, not an object; repair or remove it")
    return values


def checkpoint_stop_ids(folder: str) -> list[int]:
    """The ids a Hugging Face checkpoint's generation stops at: its generation_config.json's
    eos_token_id, else its config.json's ([] where neither names one, or there is no folder)."""
    if not folder:
        return []
    path = pathlib.Path(folder)
    listed = listed_ids(read_json(path / GENERATION_FILE).get("eos_token_id"))
    return listed or listed_ids(read_json(path / "config.json").get("eos_token_id"))


def reads_tokenizer_of(tokenizer_path: str, folder: str) -> bool:
    """Whether the tokenizer.json at `tokenizer_path` is the checkpoint `folder`'s own."""
    if not tokenizer_path or not folder:
        return False
    return pathlib.Path(tokenizer_path).absolute().parent == pathlib.Path(folder).absolute()


def stop_ids(eos_id: int, base: str, tokenizer_path: str, end_of_turn: int | None = None) -> list[int]:
    """The ids generation stops at, in order and each once: `eos_id` (the run's data.eos_id,
    -1: none), `end_of_turn` (the chat template's, None: none), then those the checkpoint
    `base` lists (checkpoint.init_from) where `tokenizer_path` is its own tokenizer."""
    ids = [eos_id] if eos_id >= 0 else []
    ids += [end_of_turn] if end_of_turn is not None else []
    ids += checkpoint_stop_ids(base) if reads_tokenizer_of(tokenizer_path, base) else []
    return list(dict.fromkeys(ids))


def run_end_of_turn(data: Any) -> int | None:
    """The end-of-turn id of a run's chat template (data.chat_template, else the one beside
    data.tokenizer), None where the run has no tokenizer or its tokenizer no template."""
    from jaxpar.data.chat import end_of_turn_id, template_for
    from jaxpar.data.text import TextSpec, load_tokenizer

    if not data.tokenizer or not pathlib.Path(data.tokenizer).is_file():
        return None
    try:
        template = template_for(data.tokenizer, data.chat_template)
    except ConfigError:
        if data.chat_template:  # named, so it must be there
            raise
        return None  # a tokenizer without a template: a model for text alone
    return end_of_turn_id(load_tokenizer(TextSpec("", data.tokenizer)), template)


def generation_config(config: Any) -> dict:
    """What an export of a run of `config` writes as generation_config.json ({}: nothing to
    write): the base checkpoint's file (checkpoint.init_from) with eos_token_id the run's stop
    ids (stop_ids: data.eos_id first, its chat template's end of turn, the base's where the
    run reads the base's tokenizer) and bos_token_id the run's data.bos_id where it has one.
    The base's other token ids (pad_token_id, ...) are kept only where the run reads its
    tokenizer."""
    data, base = config.data, config.checkpoint.init_from
    same_tokens = reads_tokenizer_of(data.tokenizer, base)  # else the base's ids name another tokenizer's tokens
    kept = {k: v for k, v in (read_json(pathlib.Path(base) / GENERATION_FILE) if base else {}).items()
            if k not in DROPPED and (same_tokens or not k.endswith("_token_id"))}
    ids = stop_ids(data.eos_id, base, data.tokenizer, run_end_of_turn(data))
    if ids:
        kept["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    if data.bos_id >= 0:
        kept["bos_token_id"] = data.bos_id
    return kept


__all__ = ["GENERATION_FILE", "checkpoint_stop_ids", "generation_config", "listed_ids", "stop_ids"]
