"""Where generation stops (jaxpar.hf.generation): the ids a checkpoint lists, the ids a run
stops at, and the generation_config.json and config.json end-of-text id an export writes, each
consistent with the data.eos_id the run trained with."""

import json
import pathlib
import shutil

import pytest

from jaxpar.config import Config, DataConfig, apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.hf.generation import (
    checkpoint_stop_ids,
    generation_config,
    listed_ids,
    stop_ids,
)

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"


def checkpoint(folder: pathlib.Path, config: dict, generation: dict | None = None, tokenizer: str = "") -> str:
    """A Hugging Face folder of `config` (config.json), `generation` (generation_config.json)
    and the tokenizer (and template) of tests/golden/chat/`tokenizer`."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    if tokenizer:
        for f in (GOLDEN / "chat" / tokenizer).iterdir():
            shutil.copy(f, folder / f.name)
    return str(folder)


def test_a_checkpoint_lists_its_stop_ids_in_either_file(tmp_path):
    assert listed_ids(2) == [2] and listed_ids([151645, 151643]) == [151645, 151643] and listed_ids(None) == []
    assert listed_ids([True, -1, "2", 3]) == [3]  # nothing but ids
    both = checkpoint(tmp_path / "both", {"eos_token_id": 0}, {"eos_token_id": [2, 0]})
    config_only = checkpoint(tmp_path / "config_only", {"eos_token_id": 0})
    assert checkpoint_stop_ids(both) == [2, 0] and checkpoint_stop_ids(config_only) == [0]
    assert checkpoint_stop_ids("") == [] and checkpoint_stop_ids(str(tmp_path / "none")) == []
    (tmp_path / "both" / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"generation_config.json' is not readable JSON \(JSONDecodeError: "):
        checkpoint_stop_ids(both)


def test_a_run_stops_at_its_end_of_text_its_end_of_turn_and_its_bases_ids_with_the_bases_tokenizer(tmp_path):
    base = checkpoint(tmp_path / "base", {"eos_token_id": 0}, {"eos_token_id": [0, 5]}, tokenizer="chatml")
    own = f"{base}/tokenizer.json"
    assert stop_ids(0, base, own, end_of_turn=2) == [0, 2, 5]  # each once, the run's first
    assert stop_ids(-1, base, own) == [0, 5]
    assert stop_ids(3, base, str(GOLDEN / "llama_tied" / "tokenizer.json")) == [3]  # another tokenizer: not the base's
    assert stop_ids(-1, "", own) == []


def run(tmp_path, base: str, *overrides: str) -> Config:
    from jaxpar.models.llama import LlamaConfig

    config = Config(model=LlamaConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
                                      mlp=64), data=DataConfig())
    return apply_overrides(config, [f"checkpoint.init_from={base}", *overrides])


def test_an_export_of_a_chat_fine_tune_stops_at_its_end_of_turn(tmp_path):
    """Qwen3-style: config.json's end of text <|endoftext|> (0), the ChatML template's end of
    turn <|im_end|> (2): the export's generation_config.json lists both, the run's data.eos_id
    first, and keeps the base's other settings but transformers' own bookkeeping."""
    base = checkpoint(tmp_path / "base", {"eos_token_id": 0},
                      {"eos_token_id": 0, "pad_token_id": 0, "temperature": 0.7, "_from_model_config": True,
                       "transformers_version": "5.24.0"}, tokenizer="chatml")
    config = run(tmp_path, base, f"data.tokenizer={base}/tokenizer.json", "data.eos_id=0")
    assert generation_config(config) == {"eos_token_id": [0, 2], "pad_token_id": 0, "temperature": 0.7}
    bare = checkpoint(tmp_path / "bare", {"eos_token_id": 0}, tokenizer="headers")  # no generation_config.json
    with_bos = run(tmp_path, bare, f"data.tokenizer={bare}/tokenizer.json", "data.bos_id=0")
    assert generation_config(with_bos) == {"eos_token_id": [3, 0], "bos_token_id": 0}  # <|eot_id|>, then the base's


def test_an_export_names_the_end_of_text_the_run_trained_with(tmp_path):
    """The DeepSeek docs' command: a base whose config.json names eos 1 and bos 0, trained with
    another tokenizer and data.eos_id=2. generation_config.json names 2 alone (the base's ids
    name the base tokenizer's tokens), and config.json's eos_token_id is 2, not the base's."""
    from jaxpar.commands.export import _base_config

    base = checkpoint(tmp_path / "base", {"eos_token_id": 1, "bos_token_id": 0, "max_position_embeddings": 4096},
                      {"eos_token_id": 1, "bos_token_id": 0, "do_sample": True})
    config = run(tmp_path, base, f"data.tokenizer={GOLDEN / 'llama_tied' / 'tokenizer.json'}", "data.eos_id=2")
    assert generation_config(config) == {"eos_token_id": 2, "do_sample": True}
    assert _base_config(config) == {"eos_token_id": 2, "bos_token_id": 0, "max_position_embeddings": 4096}
    assert generation_config(run(tmp_path, "")) == {}  # from scratch with no end of text: nothing to write
    scratch = run(tmp_path, "", f"data.tokenizer={GOLDEN / 'chat' / 'turns' / 'tokenizer.json'}", "data.eos_id=2")
    assert generation_config(scratch) == {"eos_token_id": [2, 4]}  # <eos>, <end_of_turn>
