"""A model family's Hugging Face format, beside its model rather than on its config.

A family's format is an `HFFormat`: the config.json architectures it reads, the translation
of config.json to the model config and back, and where each parameter lies among the
checkpoint's tensors. The family registers it with its model (`jaxpar.families.Family(name,
ConfigClass, hf=HFFormat(...))`), and jaxpar.hf asks the registry for a config's format
(`format_of(model)`), so the model config holds only its hyperparameters, factories, cost
model and capabilities. A format of one family is built from another's with
`dataclasses.replace` (Qwen3's is Llama's with its own names and window; Qwen3-MoE's, Qwen3's
with experts).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from jaxpar.errors import ConfigError
from jaxpar.families import hf_format
from jaxpar.hf.weights import Weight
from jaxpar.model import model_name


def nothing_ignored(model: Any) -> tuple[str, ...]:
    """A format whose checkpoints hold no tensor the model leaves unread."""
    return ()


@dataclasses.dataclass(frozen=True)
class HFFormat:
    """How a family's models lie in Hugging Face's format.

    `architectures`: the config.json `architectures` it reads ("LlamaForCausalLM",);
    `from_hf(hf)`: config.json's dict -> the model config (refusing what the model does not
    compute); `to_hf(model)`: the model config -> config.json's dict (refusing what the format
    cannot hold); `weights(model)`: {parameter path: jaxpar.hf.Weight}.
    """

    architectures: tuple[str, ...]
    from_hf: Callable[[dict], Any]
    to_hf: Callable[[Any], dict]
    weights: Callable[[Any], dict[str, Weight]]
    # model -> checkpoint tensors the import may leave unread (a tied model's lm_head; a name
    # ending in "." leaves every tensor under it: a layer the model has no place for)
    ignored: Callable[[Any], tuple[str, ...]] = nothing_ignored
    training_fields: tuple[str, ...] = ()  # model fields free to differ from the checkpoint's config (remat, routing)
    # {prefix of a checkpoint's tensor names: the prefix `weights` uses}, applied before matching
    # (transformers' checkpoint conversion mapping: the text model of a
    # Gemma3ForConditionalGeneration under language_model.model. or model.language_model.)
    renames: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.architectures:
            raise ValueError("HFFormat: give the config.json architectures it reads, e.g. ('LlamaForCausalLM',)")


def format_of(model: Any) -> HFFormat:
    """The Hugging Face format `model`'s family registers (jaxpar.families), refused in one
    line for a model without one: worded for every caller (export, checkpoint.init_from),
    which may add its own way out."""
    found = hf_format(model)
    if found is None:
        raise ConfigError(f"model {model_name(model)} declares no Hugging Face format, so its weights can be neither "
                          "read from nor exported as a Hugging Face checkpoint; give its family one to do either "
                          "(jaxpar.families.Family(..., hf=jaxpar.hf.HFFormat(...)), docs/your_model.md)")
    return found


__all__ = ["HFFormat", "format_of", "nothing_ignored"]
