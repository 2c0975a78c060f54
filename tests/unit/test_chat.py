"""Chat data (jaxpar.data.chat, data.source=chat): conversations rendered with the chat
template as transformers renders them (golden ids: tests/golden/make.py --chat), the loss on
the assistant's tokens only, packing, held-out rows, and bad input refused in one line.
Training on them under a sharded layout equals one device (fp32, 1e-5, as every layout test).

The sharded training run is tests/equivalence/test_chat.py."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from jaxpar.config import Config, DataConfig, TrainConfig, apply_overrides
from jaxpar.data.chat import (
    ChatEncoder,
    Conversation,
    lm_rows,
    pack,
    read_conversations,
    template_for,
)
from jaxpar.data.text import TextSpec, load_tokenizer
from jaxpar.errors import ConfigError

GOLDEN = pathlib.Path(__file__).parents[1] / "golden" / "chat"
CASES = sorted(p.name for p in GOLDEN.iterdir())
# What each template writes after an assistant turn's content: the loss covers it too (the
# model learns to end its turn).
TURN_END = {"chatml": "<|im_end|>\n", "headers": "<|eot_id|>", "turns": "<end_of_turn>\n", "marked": "<|im_end|>"}
TRIMS = {"chatml": False, "headers": True, "turns": True, "marked": False}  # the template trims each content


def encoder(case: str) -> ChatEncoder:
    path = str(GOLDEN / case / "tokenizer.json")
    tokenizer = load_tokenizer(TextSpec("", path))
    return ChatEncoder(tokenizer, lambda: template_for(path))


@pytest.mark.parametrize("case", CASES)
def test_conversations_tokenize_as_transformers_renders_them(case):
    """Each conversation's ids equal apply_chat_template's (whole, and as a prompt with the
    generation prompt); the loss mask covers exactly each assistant turn's content and the
    template's end of turn; a conversation the template refuses is refused with its words."""
    chat = encoder(case)
    expected = json.loads((GOLDEN / case / "expected.json").read_text())
    for n, want in enumerate(expected):
        where = f"conversation {n}"
        if "error" in want:
            with pytest.raises(ConfigError, match=rf"^{where}: the chat template refuses the conversation: ") as refused:
                chat.encode({"messages": want["messages"]}, where)
            assert "roles must alternate" in want["error"] and "roles must alternate" in str(refused.value)
            continue
        got = chat.encode({"messages": want["messages"]}, where)
        assert got.ids.tolist() == want["ids"], where
        if "assistant_mask" in want:  # the template marks the assistant's text ({% generation %})
            assert got.mask.astype(int).tolist() == want["assistant_mask"], where
        prompt = chat.tokenizer.encode(chat.template.render(want["messages"][:-1], True), add_special_tokens=False).ids
        assert prompt == want["prompt_ids"], where
        answers = [m["content"].strip() if TRIMS[case] else m["content"] for m in want["messages"] if m["role"] == "assistant"]
        spans = np.split(got.ids, np.flatnonzero(np.diff(got.mask.astype(int))) + 1)
        masked = [s for s, on in zip(spans, np.split(got.mask, np.flatnonzero(np.diff(got.mask.astype(int))) + 1))
                  if on[0]]
        decoded = [chat.tokenizer.decode(s.tolist(), skip_special_tokens=False) for s in masked]
        assert decoded == [chat.tokenizer.decode(chat.tokenizer.encode(a + TURN_END[case]).ids, skip_special_tokens=False)
                           for a in answers], where
    assert any("error" in w for w in expected) == (case == "turns")  # its roles must alternate: no system turn


def test_packing_keeps_conversations_apart_and_weighs_the_assistant_alone():
    """Three conversations of 5, 4 and 7 tokens into rows of 9: [5 + 4], [7 + padding]; the
    third is cut to... nothing: it fits. Targets weigh 1 only where the loss covers the target
    and its input is of the same conversation; positions restart; padding is a segment of its own."""
    conversations = [Conversation(np.arange(1, 6, dtype=np.int32), np.array([0, 0, 1, 1, 1], bool)),
                     Conversation(np.arange(11, 15, dtype=np.int32), np.array([0, 1, 1, 0], bool)),
                     Conversation(np.arange(21, 28, dtype=np.int32), np.array([0, 0, 0, 0, 1, 1, 1], bool))]
    rows = pack(conversations, seq_len=8)
    assert rows.ids.tolist() == [[1, 2, 3, 4, 5, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26, 27, 0, 0]] and rows.cut == 0
    batch = lm_rows(rows.ids, rows.mask, rows.segments)
    assert batch["weights"].tolist() == [[0, 1, 1, 1, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1, 0, 0]]
    assert batch["positions"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0]]
    assert batch["segment_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 2]]
    long = pack([Conversation(np.arange(12, dtype=np.int32), np.ones(12, bool))], seq_len=8)
    assert long.cut == 1 and long.ids.tolist() == [list(range(9))]


def chat_config(tmp_path, records: list[dict | str], case: str = "chatml", **data) -> Config:
    """A tiny Llama on `records` (each a JSON object, or a line as it is) with `case`'s tokenizer."""
    path = tmp_path / "chats.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    from jaxpar.models.llama import LlamaConfig

    return Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
        train=TrainConfig(steps=2, global_batch=8, seq_len=160, compute_dtype="float32"),
        data=DataConfig(source="chat", path=str(path), tokenizer=str(GOLDEN / case / "tokenizer.json"), **data))


@pytest.mark.parametrize("records, data, message", [
    ([{"messages": [{"role": "user", "content": "hi"}]}], {},
     r"line 1: the conversation has no assistant turn, nothing to train on"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
     {"chat_template": "/no/such.jinja"}, r"^data.chat_template='/no/such.jinja' is not a file"),
    ([{"text": "hi"}], {}, r"line 1 holds no conversation \(its keys: 'text'\); give 'messages'"),
    ([{"messages": "hi"}], {}, r"line 1: 'messages' is not a list of messages"),
    ([{"prompt": "q", "completion": ""}], {}, r"line 1: the completion is empty"),
    # roles: the file, the line, the message and the roles the template takes
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "Assistant", "content": "yo"}]}], {},
     r"^data.path='.*' line 1: 'messages' message 1 has role 'Assistant', which the chat template does not take "
     r"\(roles are lowercase: 'assistant'\); use one of system, user, assistant$"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
      {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "bot", "content": "yo"}]}], {},
     r"line 2: 'completion' message 0 has role 'bot', which the chat template does not take; use one of system, user, "
     r"assistant$"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}], {},
     r"line 1: 'messages' message 1 has role 'tool', which the chat template does not take; use one of system"),
    (["{\"messages\": [}"], {}, r"line 1 is not JSON \(Expecting value at column 15\); give one JSON object a line$"),
])
def test_bad_conversations_are_refused_in_one_line(tmp_path, records, data, message):
    with pytest.raises(ConfigError, match=message):
        read_conversations(chat_config(tmp_path, records, **data).data, 128)


def test_a_tokenizer_without_a_template_is_refused(tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text((GOLDEN / "chatml" / "tokenizer.json").read_text())
    config = chat_config(tmp_path, [{"messages": [{"role": "user", "content": "a"},
                                                  {"role": "assistant", "content": "b"}]}])
    data = dataclasses.replace(config.data, tokenizer=str(tmp_path / "tok" / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"^data.tokenizer='.*' has no chat template beside it \(chat_template.jinja, "
                                          r"or tokenizer_config.json's chat_template\); give one with data.chat_template"):
        read_conversations(data, 128)


def test_parquet_conversations_read_as_jsonl_lines(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"messages": m["messages"]} for m in json.loads((GOLDEN / "chatml" / "expected.json").read_text())]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chats.parquet")
    data = chat_config(tmp_path, records).data
    from_parquet = read_conversations(dataclasses.replace(data, path=str(tmp_path / "chats.parquet")), 128)
    from_jsonl = read_conversations(data, 128)
    assert [c.ids.tolist() for c in from_parquet] == [c.ids.tolist() for c in from_jsonl]
    assert [c.mask.tolist() for c in from_parquet] == [c.mask.tolist() for c in from_jsonl]


def test_a_template_that_names_tool_results_takes_them(tmp_path):
    """tool (and ipython, developer) join the roles where the template's text names them."""
    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'tool' %}{{ '<|im_start|>tool\\n' + m['content'] }}"
                        "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}{% endif %}"
                        "{{ '<|im_end|>\\n' }}{% endfor %}")
    records = [{"messages": [{"role": "user", "content": "6 x 7?"}, {"role": "tool", "content": "42"},
                             {"role": "assistant", "content": "42."}]}]
    conversation, = read_conversations(chat_config(tmp_path, records, chat_template=str(template)).data, 128)
    assert template_for(str(GOLDEN / "chatml" / "tokenizer.json"), str(template)).roles == ("system", "user",
                                                                                            "assistant", "tool")
    assert conversation.mask.any()


@pytest.mark.parametrize("case", CASES)
def test_the_end_of_turn_is_the_special_token_after_an_assistant_answer(case, tmp_path):
    """What a chat model's answer stops at: the first special token the template writes after
    an assistant's content (each golden template's); Llama 2's, written as eos_token after
    a space; else the tokenizer_config's eos_token; None where there is neither."""
    from jaxpar.data.chat import Template, end_of_turn_id

    chat = encoder(case)
    chat.template = chat.load_template()
    want = TURN_END[case].strip()
    assert chat.tokenizer.id_to_token(end_of_turn_id(chat.tokenizer, chat.template)) == want
    llama2 = Template("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                      "' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}",
                      {"bos_token": "<unk>", "eos_token": "</s>"})
    plain = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    tokenizer = load_tokenizer(TextSpec("", str(GOLDEN.parent / "llama_tied" / "tokenizer.json")))
    assert end_of_turn_id(tokenizer, llama2) == tokenizer.token_to_id("</s>") == 2
    assert end_of_turn_id(tokenizer, Template(plain, {"eos_token": "</s>"})) == 2  # no token after it: eos_token
    assert end_of_turn_id(tokenizer, Template(plain, {})) is None


def test_chat_that_leaves_no_trained_token_is_refused_before_compile(tmp_path):
    """Rows too short for any assistant token: one line naming train.seq_len, its value and
    the smallest that keeps one, before anything compiles (the loss would be 0 / 0). Some of
    them only: the cut warning counts those that keep none. The start line counts
    conversations, tokens, trained tokens, rows, how full they are, and the epochs."""
    import warnings

    from jaxpar.data.sources import make_source
    from jaxpar.errors import JaxparWarning
    from jaxpar.train import build, run

    long = {"messages": [{"role": "user", "content": "A question that takes many tokens to ask. " * 3},
                         {"role": "assistant", "content": "Short."}]}
    short = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello there."}]}
    config = chat_config(tmp_path, [long, long])
    ids = encoder("chatml").encode(long, "long")
    first = int(np.flatnonzero(ids.mask)[0])  # the place of the first assistant token
    cut = apply_overrides(config, ["mesh.data=8", f"train.seq_len={first - 1}"])

    class NoCompile:
        def lower(self, *args):
            raise AssertionError("compiled before the bad input was refused")

    message = (rf"^train.seq_len={first - 1} leaves no token to train on: each of the 2 conversations of "
               rf"data.path='.*chats.jsonl' is cut to {first} tokens before its first assistant token; set train.seq_len to at least {first} \(keeps one\), "
               rf"or {len(ids.ids) - 1} to keep every one whole$")
    with pytest.raises(ConfigError, match=message):
        run(dataclasses.replace(build(cut), step=NoCompile()), progress=False)

    mixed = apply_overrides(chat_config(tmp_path, [long, short] * 4), ["mesh.data=8", f"train.seq_len={first - 1}"])
    with pytest.warns(JaxparWarning, match=r"4 of 8 conversations are longer than train.seq_len \+ 1 = .* and were cut to "
                                           r"it, and 4 keep no token to train on \(cut before their first assistant token\)"):
        source = make_source(build(mixed).batch, mixed)
    rows = source.reader.rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole = apply_overrides(chat_config(tmp_path, [long, short] * 4), ["mesh.data=8",
                                                                            f"train.seq_len={len(ids.ids) - 1}"])
        line = make_source(build(whole).batch, whole).describe(10)
    assert rows.trained > 0  # the short ones'
    # whole: every conversation's tokens, its masked ones after the first, a row each (neither fits beside the long one)
    pair = [encoder("chatml").encode(r, "") for r in (long, short)]
    tokens, trained, width = 4 * sum(len(c.ids) for c in pair), 4 * sum(int(c.mask[1:].sum()) for c in pair), len(ids.ids)
    assert line == (f"data: chat '{tmp_path / 'chats.jsonl'}' | 8 conversations, {tokens:,} tokens, {trained} of them "
                    f"trained (the assistant's) | 8 rows of {width} tokens, {tokens / (8 * width):.1%} filled | 10 steps x "
                    "8 rows = 10 epochs (rows at random: data.order=windows)")
