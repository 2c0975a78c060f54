"""The jitted program: a config's layout, the sharded state, and the step that updates it
(gradients, how they are summed over data, the optimizer update, pipelined and compressed
gradients, LoRA, the losses). `trainer.build` composes them; nothing here runs on the host
between steps (that is jaxpar.loop) or generates (jaxpar.generate)."""
