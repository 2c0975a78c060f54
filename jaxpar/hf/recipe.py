"""The recipe `hf:FOLDER`: fine-tune a Hugging Face checkpoint.

    jaxpar train hf:path/to/checkpoint --set data.source=text --set data.path=corpus.txt

The model is the checkpoint's (its config.json, jaxpar.hf.model_config), the weights are
read from it at the start (checkpoint.init_from), and its tokenizer.json, end-of-text id and
the id the tokenizer puts before a text (its <bos>; none for Qwen) become data.tokenizer,
data.eos_id and data.bos_id. Everything else is jaxpar's defaults with a
fine-tuning learning rate; --set changes any of it (mesh.*, train.*, ...).

The data stays synthetic unless --set names some: `jaxpar explain` and `plan` read the recipe
as it is, where data does not matter. A training run says so in its first line and warns
that random tokens unlearn the checkpoint (jaxpar.data.sources.make_source).
"""

from __future__ import annotations

import pathlib

from jaxpar.config import CheckpointConfig, Config, DataConfig, OptimConfig, TrainConfig
from jaxpar.data.text import TextSpec, begin_id, load_tokenizer
from jaxpar.errors import ConfigError
from jaxpar.hf.config import read_config
from jaxpar.hf.load import model_config
from jaxpar.mesh import MeshConfig


def recipe(folder: str) -> Config:
    path = pathlib.Path(folder)
    model = model_config(path)
    eos = read_config(path).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    tokenizer = path.absolute() / "tokenizer.json"  # sample and export read it again, from anywhere
    bos = _begin_id(tokenizer)
    return Config(
        model=model,
        mesh=MeshConfig(data=-1),
        train=TrainConfig(steps=100, global_batch=16, seq_len=256),
        optim=OptimConfig(lr=1e-4, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0),
        data=DataConfig(tokenizer=str(tokenizer) if tokenizer.is_file() else "",
                        eos_id=eos if isinstance(eos, int) and 0 <= eos < model.vocab_size else -1,
                        bos_id=bos if bos < model.vocab_size else -1),
        checkpoint=CheckpointConfig(init_from=str(path.absolute())),  # export reads it again, from anywhere
    )


def _begin_id(tokenizer: pathlib.Path) -> int:
    """The id the checkpoint's tokenizer puts before a text (-1: none, or no tokenizer to ask;
    an unreadable one is told of when a run reads it)."""
    try:
        return begin_id(load_tokenizer(TextSpec("", str(tokenizer)))) if tokenizer.is_file() else -1
    except ConfigError:
        return -1
