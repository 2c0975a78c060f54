"""What jaxpar.hf reads of a built step: the typed surface of `jaxpar.step.trainer.Trainer`
that importing and exporting use, and nothing more. jaxpar.hf sits below the step in the
layers (docs/architecture.md), so it names the members it needs here instead of importing
the Trainer; a Trainer is a `StepProgram` as it stands."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

from jaxpar.sharding import Layout

Tree = Any  # a pytree of parameters or a TrainState


class StepProgram(Protocol):
    config: Any  # jaxpar.config.Config (a layer above): the model, train.compute_dtype, lora, data's ids
    layout: Layout  # the mesh and the pipeline's chunks the weights rest in
    lora_targets: Mapping[str, Any] | None  # LoRA's adapted weights by path (jaxpar.step.lora.Target)
    init: Callable[[], Tree]  # () -> the TrainState at step 0 from the seed (its draws for new weights)
    start_from: Callable[[Tree], Tree]  # float32 weights in model order -> the TrainState at step 0
    model_order: Callable[[Tree], Tree]  # a stored tree -> the model's layer order
    pipeline_order: Callable[[Tree], Tree]  # and back
    stage_split: Any  # jaxpar.pipeline.split.StageSplit: the layers of each stage (None without stages)

    def abstract_state(self) -> Tree: ...

    def model_order_state(self) -> Tree: ...  # abstract_state() in model order (unpadded)

    def master_params(self, state: Tree) -> Tree: ...

    def master_weights(self, state: Tree) -> Tree: ...
