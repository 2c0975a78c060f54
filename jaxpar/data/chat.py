"""Conversations in: chat data rendered with the checkpoint's own chat template, the loss on
the assistant's tokens only, packed into rows with segment ids (data.source=chat).

A record is a JSON object a line of a .jsonl file, or a row of a .parquet file, holding
  * `messages` (data.messages_field): a conversation, [{"role", "content"}, ...], rendered
    with the chat template; the loss covers each assistant turn's tokens as the template
    writes them (its content and the end-of-turn text after it), nothing else; or
  * `prompt` and `completion`: plain texts (no template: prompt ids then completion ids,
    data.bos_id before, data.eos_id after, as text documents get them) or conversations
    (lists of messages, rendered together); the loss covers the completion.
A message's role is one the template takes (ROLES, and OPTIONAL_ROLES where its text names
them); any other is refused, naming the record, as is data that rows of train.seq_len + 1
tokens cut before every trained token (its loss would be 0 / 0).

The template is the tokenizer's (`chat_template.jinja` beside the tokenizer.json, else the
`chat_template` of its tokenizer_config.json) or data.chat_template's file. It is rendered
with jinja2's sandboxed environment, as `transformers` renders it (`apply_chat_template`):
a template comes with a stranger's checkpoint, and the sandbox keeps it from reaching
Python. The rendered text is tokenized as one, special tokens written in it read as theirs
(tests/unit/test_chat.py holds the ids against transformers' for several templates).

Which tokens are the assistant's: each assistant turn's text is what rendering the
conversation up to it adds to rendering the conversation before it with the generation
prompt. A template that renders earlier turns differently once a later one is added
(one that drops reasoning from past turns, say) is refused for that conversation, naming it.

Packing: conversations, in file order, fill rows of train.seq_len + 1 tokens one after
another (a conversation that does not fit starts the next row; one longer than a row is cut
to it, and counted). Each conversation is a segment of its own: its tokens attend only to
each other and their positions count from 0. A row's rest is padding, weighing nothing. Rows
are read as a token file's are (data.order: epochs, every row once per epoch in an order
drawn from (seed, epoch); windows, rows drawn from (seed, step)), so a resumed run reads the
batches of an uninterrupted one. data.eval_fraction holds the last conversations out.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxpar.data.batch import BatchLayout
from jaxpar.data.order import whole_rows_order
from jaxpar.data.text import (
    CONFIG_NAMES,
    TextSpec,
    document_files,
    json_error,
    load_tokenizer,
    parquet_file,
)
from jaxpar.errors import ConfigError

CHAT_KINDS = ".jsonl or .parquet"
TEMPLATE_FILE = "chat_template.jinja"  # beside tokenizer.json, as transformers saves it


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One record's tokens: ids [n] and which of them the loss covers, mask [n]."""

    ids: np.ndarray
    mask: np.ndarray


# ------------------------------------------------------------------ the template

def find_template(tokenizer_path: str, given: str = "") -> str:
    """The chat template's text: data.chat_template's file when `given` (a .jinja file, or a
    tokenizer_config.json), else the tokenizer's own, beside its tokenizer.json."""
    if given:
        path = pathlib.Path(given)
        if not path.is_file():
            raise ConfigError(f"data.chat_template={given!r} is not a file; give a .jinja chat template or a "
                              "tokenizer_config.json that holds one")
        return path.read_text(encoding="utf-8") if path.suffix != ".json" else _config_template(path, "data.chat_template")
    folder = pathlib.Path(tokenizer_path).parent
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        return _config_template(config, "data.tokenizer")
    raise ConfigError(f"data.tokenizer={tokenizer_path!r} has no chat template beside it ({TEMPLATE_FILE}, or "
                      "tokenizer_config.json's chat_template); give one with data.chat_template=FILE")


def _config_template(path: pathlib.Path, field: str) -> str:
    """The chat_template of a tokenizer_config.json: a string, or the one named "default" of a list."""
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, AttributeError):
        raise ConfigError(f"{field}: {str(path)!r} is not a JSON object; give a tokenizer_config.json") from None
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if not isinstance(template, str) or not template:
        raise ConfigError(f"{field}: {str(path)!r} holds no chat_template; give one with data.chat_template=FILE "
                          f"(a .jinja file)")
    return template


def special_tokens(tokenizer_path: str) -> dict[str, str]:
    """The special tokens a template may name (bos_token, eos_token, ...), as strings, from the
    tokenizer_config.json beside the tokenizer (none where there is none)."""
    config = pathlib.Path(tokenizer_path).parent / "tokenizer_config.json"
    if not config.is_file():
        return {}
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except ValueError:
        return {}
    tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        value = values.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    return tokens


class Template:
    """A chat template compiled in jinja2's sandbox, rendered as transformers renders it: the
    same environment (trim_blocks, lstrip_blocks, loop controls), the same helpers
    (raise_exception, strftime_now, a tojson that does not escape HTML, dict, a namespace
    that refuses underscore names), the tokenizer's special tokens by name, a message's
    reasoning under each name templates read, and `{% generation %}` blocks, whose text
    `spans` reports (where a template marks the assistant's tokens itself)."""

    def __init__(self, text: str, tokens: dict[str, str], field: str = "data.chat_template"):
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError("data.source=chat renders chat templates with jinja2: pip install 'jaxpar[chat]'") from None
        if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
            raise ConfigError(f"jinja2 {jinja2.__version__} has known sandbox escapes, and a chat template comes with "
                              "a stranger's checkpoint; pip install 'jinja2>=3.1.6'")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_blocks(), jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=_Dict(), namespace=_namespace())
        try:
            self.template = env.from_string(text)
        except jinja2.TemplateError as e:
            raise ConfigError(f"{field}: the chat template does not compile ({e}); give a jinja chat template") from None
        self.marks_generation = _GENERATION_TAG.search(text) is not None
        self.tokens, self.field = tokens, field
        self.roles = ROLES + tuple(r for r in OPTIONAL_ROLES if re.search(rf"""['"]{r}['"]""", text))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.spans(messages, add_generation_prompt)[0]

    def spans(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered text, the [start, end) of each `{% generation %}` block's text in it)."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _TRACKING.set((blocks, spans))
        try:
            for block in self.template.generate(messages=_with_reasoning_aliases(messages), tools=None, documents=None,
                                                add_generation_prompt=add_generation_prompt, **self.tokens):
                blocks.append(block)
        finally:
            _TRACKING.reset(token)
        return "".join(blocks), spans


def template_for(tokenizer_path: str, chat_template: str = "") -> Template:
    """The chat template of a run (find_template) with the tokenizer's special tokens."""
    return Template(find_template(tokenizer_path, chat_template), special_tokens(tokenizer_path))


def end_of_turn_id(tokenizer, template: Template) -> int | None:
    """The id that ends an assistant's turn, where a chat model's answer stops: the first
    special token the template writes after an assistant message's content (ChatML's
    <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>, Llama 2's </s>), else the
    tokenizer_config's eos_token; None where neither is one of the tokenizer's tokens."""
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    probe = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": _PROBE}]
    try:
        text = template.render(probe)
    except Exception:  # a template that refuses the probe: its eos_token below
        text = ""
    if _PROBE in text:
        after = text[text.rindex(_PROBE) + len(_PROBE):]
        found = [i for i in tokenizer.encode(after, add_special_tokens=False).ids if i in special]
        if found:
            return found[0]
    eos = template.tokens.get("eos_token")
    return tokenizer.token_to_id(eos) if eos else None


# The roles a conversation's messages may take: those of OpenAI's and Hugging Face's chat
# format, and the optional ones where the template's text names them (Qwen's and Llama 3's
# tool results, gpt-oss's developer). A role outside them (a capital "Assistant", a "bot")
# would render as a turn of its own, or none, and never be trained on: refused.
ROLES = ("system", "user", "assistant")
OPTIONAL_ROLES = ("tool", "ipython", "developer")
_PROBE = "jaxpar end-of-turn probe"  # an assistant's content, found again in the rendered text
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TRACKING: contextvars.ContextVar = contextvars.ContextVar("jaxpar_chat_generation", default=None)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read


def _generation_blocks():
    """A jinja2 extension for `{% generation %}...{% endgeneration %}`: the block renders as
    its body, and its place in the text rendered so far is recorded (Template.spans)."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    return Generation


def _with_reasoning_aliases(messages: list[dict]) -> list[dict]:
    """Each message's reasoning, given under any of REASONING_FIELDS, under all of them (as
    transformers passes it: templates read one name or another)."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


class _Dict:
    """`dict(...)` in a template, without the class itself (no attribute tricks through it)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace():
    """jinja2's namespace, refusing underscore-prefixed names (CPython's internals)."""
    import jinja2.exceptions
    import jinja2.utils

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # as transformers' own filter: jinja2's default escapes HTML, which a chat template must not
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise TemplateRefusal(message)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


class TemplateRefusal(Exception):
    """A template's own raise_exception (a conversation it does not take)."""


# ------------------------------------------------------------------ conversations to tokens

class ChatEncoder:
    """Records to Conversations: the tokenizer, the template (`load_template()`, called when
    a record first needs one: plain prompt/completion texts need none), and the ids put
    around plain texts."""

    def __init__(self, tokenizer, load_template: Callable[[], Template], bos_id: int = -1, eos_id: int = -1):
        self.tokenizer, self.load_template, self.bos_id, self.eos_id = tokenizer, load_template, bos_id, eos_id
        self.template: Template | None = None

    def encode(self, record: dict, where: str, messages_field: str = "messages") -> Conversation:
        if messages_field in record:
            messages = self._messages(record[messages_field], where, messages_field)
            return self._rendered(messages, where)
        if "prompt" in record and "completion" in record:
            prompt, completion = record["prompt"], record["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                return self._plain(prompt, completion, where)
            messages = self._messages(prompt, where, "prompt") + self._messages(completion, where, "completion")
            return self._rendered(messages, where, completion_from=len(prompt))
        keys = ", ".join(map(repr, record)) or "none"
        raise ConfigError(f"{where} holds no conversation (its keys: {keys}); give {messages_field!r} (a list of "
                          "{\"role\", \"content\"}) or \"prompt\" and \"completion\"")

    def _plain(self, prompt: str, completion: str, where: str) -> Conversation:
        if not completion:
            raise ConfigError(f"{where}: the completion is empty, nothing to train on; give it text")
        start = [self.bos_id] if self.bos_id >= 0 else []
        end = [self.eos_id] if self.eos_id >= 0 else []
        first = start + self.tokenizer.encode(prompt, add_special_tokens=False).ids
        second = self.tokenizer.encode(completion, add_special_tokens=False).ids + end
        return Conversation(np.asarray(first + second, np.int32),
                            np.asarray([False] * len(first) + [True] * len(second)))

    def _messages(self, value: Any, where: str, field: str) -> list[dict]:
        """`value` checked as a list of messages, each of a role the template takes."""
        messages = _messages(value, where, field)
        self.template = self.template or self.load_template()
        roles = self.template.roles
        for n, m in enumerate(messages):
            if m["role"] not in roles:
                case = f" (roles are lowercase: {m['role'].lower()!r})" if m["role"].lower() in roles else ""
                raise ConfigError(f"{where}: {field!r} message {n} has role {m['role']!r}, which the chat template "
                                  f"does not take{case}; use one of {', '.join(roles)}")
        return messages

    def _rendered(self, messages: list[dict], where: str, completion_from: int = 0) -> Conversation:
        """The whole conversation's ids; the mask covers the text each assistant turn at or after
        `completion_from` adds."""
        turns = [i for i in range(completion_from, len(messages)) if messages[i]["role"] == "assistant"]
        if not turns:
            raise ConfigError(f"{where}: the conversation has no assistant turn, nothing to train on; give each "
                              "conversation at least one {\"role\": \"assistant\", ...} message")
        whole, marked = self._render(messages, False, where)
        if self.template.marks_generation:  # the template marks the assistant's text itself
            prompt_end = len(self._render(messages[:completion_from], False, where)[0]) if completion_from else 0
            return self._tokens(whole, [span for span in marked if span[0] >= prompt_end])
        spans = []
        for i in turns:
            before, through = self._render(messages[:i], True, where)[0], self._render(messages[:i + 1], False, where)[0]
            if not (through.startswith(before) and whole.startswith(through)):
                raise ConfigError(f"{where}: the chat template renders the turns before assistant message {i} "
                                  "differently once it is added, so its tokens cannot be told apart; give "
                                  "data.chat_template a template that renders each turn alike, or prompt/completion "
                                  "records")
            spans.append((len(before), len(through)))
        return self._tokens(whole, spans)

    def _tokens(self, text: str, spans: list[tuple[int, int]]) -> Conversation:
        """The text's ids (tokenized as one, its special tokens as theirs); the mask covers
        the tokens that start inside a span."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        starts = np.asarray([s for s, _ in encoding.offsets])
        mask = np.zeros(len(encoding.ids), bool)
        for lo, hi in spans:
            mask |= (starts >= lo) & (starts < hi)
        return Conversation(np.asarray(encoding.ids, np.int32), mask)

    def _render(self, messages: list[dict], generation_prompt: bool, where: str) -> tuple[str, list]:
        try:
            return self.template.spans(messages, generation_prompt)
        except TemplateRefusal as e:
            raise ConfigError(f"{where}: the chat template refuses the conversation: {e}") from None
        except Exception as e:  # jinja2's errors, and a template's own mistakes
            raise ConfigError(f"{where}: the chat template fails on the conversation ({type(e).__name__}: {e})") from None


def _messages(value: Any, where: str, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {field!r} is not a list of messages; give [{{\"role\": ..., \"content\": ...}}, ...]")
    for n, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: {field!r} message {n} is not {{\"role\": TEXT, \"content\": TEXT}}")
    return value


def records(spec: TextSpec) -> Iterator[tuple[dict, str]]:
    """(record, where it is) for every record of the files spec.path names, in order."""
    for file in document_files(spec):
        if file.suffix == ".jsonl":
            yield from _jsonl_records(file, spec)
        elif file.suffix == ".parquet":
            yield from _parquet_records(file, spec)
        else:
            raise ConfigError(f"data.path={spec.path!r}: {str(file)!r} is not a {CHAT_KINDS} file of conversations")


def _named(file: pathlib.Path, spec: TextSpec) -> str:
    """How a message names a file of records: data.path, and the file too where data.path
    names a folder or a glob."""
    named = f"data.path={spec.path!r}"
    return named if pathlib.Path(spec.path) == file else f"{named}: {str(file)!r}"


def _jsonl_records(file: pathlib.Path, spec: TextSpec) -> Iterator[tuple[dict, str]]:
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{_named(file, spec)} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where} is not JSON ({json_error(e)}); give one JSON object a line") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{where} is a {type(record).__name__}, not a JSON object")
            yield record, where


def _parquet_records(file: pathlib.Path, spec: TextSpec) -> Iterator[tuple[dict, str]]:
    row = 0
    for batch in parquet_file(file, spec).iter_batches():
        for record in batch.to_pylist():
            yield record, f"{_named(file, spec)} row {row}"
            row += 1


def _encoder(data: Any, model_vocab: int | None) -> tuple[TextSpec, ChatEncoder]:
    """(where data.path's records are, their encoder): data.tokenizer, loaded and checked as
    text's is, and the chat template, read when a record first needs it."""
    spec = TextSpec(data.path, data.tokenizer, eos_id=data.eos_id, bos_id=data.bos_id, names=CONFIG_NAMES)
    tokenizer = load_tokenizer(spec, model_vocab)
    return spec, ChatEncoder(tokenizer, lambda: template_for(data.tokenizer, data.chat_template), data.bos_id,
                             data.eos_id)


def read_conversations(data: Any, model_vocab: int | None = None) -> list[Conversation]:
    """Every record of data.path as a Conversation, with data.tokenizer and the chat template."""
    spec, encoder = _encoder(data, model_vocab)
    conversations = [encoder.encode(record, where, data.messages_field) for record, where in records(spec)]
    if not conversations:
        raise ConfigError(f"data.path={data.path!r} holds no conversations; give a {CHAT_KINDS} file with some")
    return conversations


# ------------------------------------------------------------------ packing and rows

@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Rows of seq_len + 1 tokens: ids, loss mask and segment (-1: padding), [R, seq_len + 1];
    `cut`: how many conversations were longer than a row."""

    ids: np.ndarray
    mask: np.ndarray
    segments: np.ndarray
    cut: int

    def __len__(self) -> int:
        return len(self.ids)

    def fields(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """The batch fields of rows `ids` (lm_rows)."""
        return lm_rows(self.ids[ids], self.mask[ids], self.segments[ids])

    @property
    def conversations(self) -> int:
        return int((self.segments.max(axis=1) + 1).sum())

    @property
    def tokens(self) -> int:
        """The conversations' tokens (not the padding)."""
        return int((self.segments >= 0).sum())

    @property
    def trained(self) -> int:
        """The targets the loss covers (lm_rows' weights)."""
        segment_in, segment_out = self.segments[:, :-1], self.segments[:, 1:]
        return int((self.mask[:, 1:] & (segment_in == segment_out) & (segment_in >= 0)).sum())


def pack(conversations: list[Conversation], seq_len: int) -> PackedRows:
    """Conversations in order into rows of seq_len + 1 tokens, each whole where it fits in the
    row's rest, else starting the next row; one longer than a row is cut to it."""
    width = seq_len + 1
    rows: list[list[Conversation]] = [[]]
    used, cut = 0, 0
    for c in conversations:
        if len(c.ids) > width:
            c, cut = Conversation(c.ids[:width], c.mask[:width]), cut + 1
        if used + len(c.ids) > width:
            rows.append([])
            used = 0
        rows[-1].append(c)
        used += len(c.ids)
    return filled(rows, width, cut)


def filled(rows: list[list[Conversation]], width: int, cut: int) -> PackedRows:
    """Rows of `width` tokens, each its conversations one after another (segments 0, 1, ...),
    then padding (segment -1)."""
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    segments = np.full((len(rows), width), -1, np.int32)
    for r, row in enumerate(rows):
        at = 0
        for s, c in enumerate(row):
            ids[r, at:at + len(c.ids)], mask[r, at:at + len(c.ids)], segments[r, at:at + len(c.ids)] = c.ids, c.mask, s
            at += len(c.ids)
    return PackedRows(ids, mask, segments, cut)


def lm_rows(ids: np.ndarray, mask: np.ndarray, segments: np.ndarray) -> dict[str, np.ndarray]:
    """A batch's fields from packed rows [B, seq_len + 1]: a target weighs 1 where the loss covers
    it and its input is of the same conversation; padding is a segment of its own."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    segment_in, segment_out = segments[:, :-1], segments[:, 1:]
    weights = (mask[:, 1:] & (segment_in == segment_out) & (segment_in >= 0)).astype(np.float32)
    segment_ids = np.where(segment_in >= 0, segment_in, segment_in.max(initial=0) + 1).astype(np.int32)
    index = np.arange(inputs.shape[1])
    first = np.where(np.diff(segment_ids, axis=1, prepend=-1) != 0, index, 0)
    positions = (index - np.maximum.accumulate(first, axis=1)).astype(np.int32)
    return {"inputs": inputs, "targets": targets, "weights": weights, "positions": positions,
            "segment_ids": segment_ids}


class ChatRows:
    """Packed rows read by step in data.order (jaxpar.data.order.whole_rows_order): epochs,
    every row once per epoch in an order drawn from (seed, epoch) (unshuffled: held-out
    batches), or windows, rows drawn from (seed, step)."""

    def __init__(self, rows: PackedRows, order: str, batch: int, seed: int, shuffle: bool = True, first_step: int = 0):
        self.rows, self.order = rows, whole_rows_order(order, len(rows), batch, seed, shuffle, first_step)

    def row_ids(self, step: int, rows: slice) -> np.ndarray:
        return self.order.starts(step, rows)

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        return self.rows.fields(self.row_ids(step, rows))


def read_pairs(data: Any, model_vocab: int | None = None) -> list[tuple[Conversation, Conversation]]:
    """Every preference record of data.path ({"prompt", "chosen", "rejected"}: texts, or a
    prompt of messages and answers as texts or messages) as (chosen, rejected) Conversations,
    each the prompt followed by its answer, the mask on the answer."""
    spec, encoder = _encoder(data, model_vocab)
    pairs = []
    for record, where in records(spec):
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
        if missing:
            raise ConfigError(f"{where} has no {', '.join(map(repr, missing))}; give a preference record "
                              "{\"prompt\", \"chosen\", \"rejected\"}")
        empty = [k for k in ("chosen", "rejected") if not record[k]]
        if empty:
            raise ConfigError(f"{where}: {empty[0]!r} is empty; give each answer its text")
        prompt = record["prompt"]
        answers = [record[k] if isinstance(prompt, str) or not isinstance(record[k], str)
                   else [{"role": "assistant", "content": record[k]}] for k in ("chosen", "rejected")]
        pairs.append(tuple(encoder.encode({"prompt": prompt, "completion": a}, f"{where} ({k})")
                           for a, k in zip(answers, ("chosen", "rejected"))))
    if not pairs:
        raise ConfigError(f"data.path={data.path!r} holds no preference records; give a {CHAT_KINDS} file with some")
    return pairs


def pack_pairs(pairs: list[tuple[Conversation, Conversation]], seq_len: int) -> PackedRows:
    """A row a pair, of seq_len + 1 tokens: the chosen conversation (segment 0), then the
    rejected one (segment 1), then padding. A pair longer than a row has each side cut to half
    of it, and is counted."""
    width = seq_len + 1
    long = [sum(len(c.ids) for c in pair) > width for pair in pairs]
    rows = [[Conversation(c.ids[:width // 2], c.mask[:width // 2]) for c in pair] if cut else list(pair)
            for pair, cut in zip(pairs, long)]
    return filled(rows, width, sum(long))


def split_conversations(conversations: list[Conversation], fraction: float, path: str) -> tuple[list, list]:
    """(training, held out): the last `fraction` of the conversations held out (0: none)."""
    if not fraction:
        return conversations, []
    held = int(len(conversations) * fraction)
    if held < 1 or held == len(conversations):
        raise ConfigError(f"data.eval_fraction={fraction} holds out {held} of data.path={path!r}'s "
                          f"{len(conversations)} conversations; each part needs at least one: use "
                          f"{1 / len(conversations):.3g} to {1 - 1 / len(conversations):.3g}")
    return conversations[:-held], conversations[-held:]


def chat_rows(batch: BatchLayout, data: Any, vocab_size: int, seed: int) -> tuple[ChatRows, PackedRows | None]:
    """(the training rows, the held-out rows packed) of data.path, for batches laid out as `batch`.
    Conversations that rows of train.seq_len + 1 tokens cut before their first trained token
    are counted; where that leaves none to train on (or none held out to evaluate) the run is
    refused, before anything compiles: its loss would be 0 / 0."""
    conversations = read_conversations(data, vocab_size)
    training, held_out = split_conversations(conversations, data.eval_fraction, data.path)
    seq = batch.shapes["inputs"][1]
    untrained = untrained_conversations(training, seq, data.path)
    untrained_conversations(held_out, seq, data.path, "held-out ")
    rows = pack(training, seq)
    _warn_of_cuts(data.path, rows.cut, len(training), "conversations", seq, "were cut to it", untrained)
    return ChatRows(rows, data.order, batch.global_batch, seed), pack(held_out, seq) if held_out else None


def first_trained(conversation: Conversation) -> int | None:
    """The place of the conversation's first trained target: its first masked token after
    the first (a target needs an input before it); None where the mask covers none."""
    found = np.flatnonzero(conversation.mask[1:])
    return int(found[0]) + 1 if len(found) else None


def untrained_conversations(conversations: list[Conversation], seq: int, path: str, part: str = "") -> int:
    """How many of the conversations rows of seq + 1 tokens cut before their first trained
    token (train.seq_len must be at least that place); all of them is refused, naming the
    smallest train.seq_len that keeps one."""
    firsts = [first_trained(c) for c in conversations]
    lost = sum(f is None or f > seq for f in firsts)
    if conversations and lost == len(conversations):
        known = [f for f in firsts if f is not None]
        if not known:
            raise ConfigError(f"data.path={path!r}: the chat template marks none of the {part}conversations' tokens "
                              "as the assistant's; nothing to train on")
        raise ConfigError(f"train.seq_len={seq} leaves no token to train on: each of the {len(conversations)} "
                          f"{part}conversations of data.path={path!r} is cut to {seq + 1} tokens before its first "
                          f"assistant token; set train.seq_len to at least {min(known)} (keeps one), or "
                          f"{max(len(c.ids) for c in conversations) - 1} to keep every one whole")
    return lost


def preference_rows(batch: BatchLayout, data: Any, vocab_size: int, seed: int) -> ChatRows:
    """data.path's preference pairs, a row each (pack_pairs), for batches laid out as `batch`."""
    seq = batch.shapes["inputs"][1]
    rows = pack_pairs(read_pairs(data, vocab_size), seq)
    _warn_of_cuts(data.path, rows.cut, len(rows), "preference pairs", seq, "had each side cut to half of it")
    return ChatRows(rows, data.order, batch.global_batch, seed)


def _warn_of_cuts(path: str, cut: int, total: int, what: str, seq: int, how: str, untrained: int = 0) -> None:
    if cut:
        import warnings

        from jaxpar.errors import JaxparWarning

        lost = f", and {untrained} keep no token to train on (cut before their first assistant token)" if untrained else ""
        warnings.warn(f"data.path={path!r}: {cut} of {total} {what} are longer than train.seq_len + 1 = {seq + 1} "
                      f"tokens and {how}{lost}; raise train.seq_len to keep them whole", JaxparWarning, stacklevel=3)
