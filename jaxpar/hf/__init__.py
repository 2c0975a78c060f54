"""Hugging Face checkpoints in and out: safetensors and config.json, read into and written
from a trainer's sharded state under any layout.

  model_config(folder)              the jaxpar model config of a checkpoint (its config.json)
  prepare_import(trainer, folder)   checks, then () -> TrainState at step 0 with its weights
                                    (checkpoint.init_from runs this before the compile)
  export(trainer, state, folder)    the state's weights as a Hugging Face checkpoint
  format_of(model)                  the model's HFFormat, refused in one line for a model without

A model takes part through its family's format, an `HFFormat` (jaxpar.hf.format: the
architectures it reads, `from_hf` / `to_hf` between config.json's dict and the model config,
`weights` ({parameter path: jaxpar.hf.Weight}), and optionally `ignored`, `training_fields`
and `renames`), registered with its model: `jaxpar.families.register(Family(name,
ConfigClass, hf=HFFormat(...)))`. models/llama.py (Llama 2, 3, 3.1, 3.2) and models/moe.py
(Mixtral) are the examples; docs/your_model.md shows one for a model of one's own.
docs/checkpoints_and_data.md walks through a fine-tune. What these functions read of the
trainer they are given is typed as `jaxpar.hf.program.StepProgram`.
"""

from jaxpar.hf.format import HFFormat, format_of
from jaxpar.hf.load import model_config, prepare_import
from jaxpar.hf.save import export
from jaxpar.hf.weights import Weight

__all__ = ["HFFormat", "Weight", "export", "format_of", "model_config", "prepare_import"]
