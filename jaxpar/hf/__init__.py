"""Hugging Face checkpoints in and out: safetensors and config.json, read into and written
from a trainer's sharded state under any layout.

  model_config(folder)              the jaxpar model config of a checkpoint (its config.json)
  prepare_import(trainer, folder)   checks, then () -> TrainState at step 0 with its weights
                                    (checkpoint.init_from runs this before the compile)
  export(trainer, state, folder)    the state's weights as a Hugging Face checkpoint
  register(config_class)            read checkpoints of a model config of one's own (a family
                                    of its own: jaxpar.families.register takes presets too)

A model takes part by declaring its format on its config: `hf_architectures`, `from_hf(hf)`
(a classmethod: config.json's dict -> the config), `to_hf()`, `hf_weights()` ({parameter
path: jaxpar.hf.weights.Weight}) and optionally `hf_ignored()` and `hf_training_fields`
(jaxpar.model lists them), and registers its family (jaxpar.families). models/llama.py
(Llama 2, 3, 3.1, 3.2) and models/moe.py (Mixtral) are the examples.
docs/checkpoints_and_data.md walks through a fine-tune.
"""

from jaxpar.hf.load import model_config, prepare_import, register
from jaxpar.hf.save import export
from jaxpar.hf.weights import Weight

__all__ = ["Weight", "export", "model_config", "prepare_import", "register"]
