"""A small Llama in 2 pipeline stages (1F1B, 8 microbatches) with ZeRO-1.

Cut into 2 pipeline stages, on stage x data x tensor (+SP) = 2 x 2 x 2 with ZeRO-1 (8
devices), trained with the 1F1B schedule over 8 microbatches.

  jaxpar train llama_pp --set train.steps=30
  jaxpar train llama_pp --set parallel.pipeline.schedule=interleaved --set parallel.pipeline.chunks=2
  jaxpar explain llama_pp
"""

from jaxpar.config import Config, OptimConfig, ParallelConfig, PipelineConfig, TensorConfig, TrainConfig, ZeroConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.llama import LlamaConfig


def recipe() -> Config:
    return Config(
        model=LlamaConfig(vocab_size=256, embed=128, num_layers=8, num_heads=16, num_kv_heads=8, head_dim=8, mlp=384),
        mesh=MeshConfig(stage=2, data=-1, tensor=2),
        parallel=ParallelConfig(tensor=TensorConfig(sequence_parallel=True), zero=ZeroConfig(stage=1),
                                pipeline=PipelineConfig(schedule="1f1b")),
        train=TrainConfig(steps=60, global_batch=32, seq_len=64, microbatches=8, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
    )
