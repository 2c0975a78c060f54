"""The planner's step time on a GPU it has never seen: a roofline over a compiled step's
FLOPs, its HBM traffic and its collectives (jaxpar.plan ranks layouts by it; each layout's
child process, jaxpar.plan.compile_one, computes it)."""

from __future__ import annotations

from jaxpar.pipeline.lockstep import lockstep_cost
from jaxpar.pipeline.split import head_layers, leading_layers, stage_split
from jaxpar.plan.presets import Hardware
from jaxpar.sharding import Layout

MODEL_AXES = {"tensor", "context", "expert"}


def roofline(report, config, layout: Layout, hw: Hardware, hbm_bytes: float, host_s: float = 0.0) -> dict[str, float]:
    """Step time on `hw` from a compiled step: its matmul FLOPs at the matmul efficiency (float32
    ones at TF32's half rate) or `hbm_bytes` at HBM speed, whichever is longer (stretched by
    the pipeline's lockstep ticks: `pipeline_bubble`), then Muon's iteration at its dtype's
    rate, plus the collective time the overlap does not hide.
    Collectives across hosts run at the per-device network speed, the rest at NVLink's.
    The CPU backend widens bf16 collectives of activations to f32; on GPUs they stay bf16,
    so such bytes count half. Collectives over data run at `hw.group_link_gb_per_s` where
    it is set (data's replicas in other clusters), and DiLoCo's exchange there is not
    hidden (its switch's branches weighed by how often they run). (HBM traffic comes from formulas: the CPU compiler's own count
    reflects its weaker fusion.) `host_s`: the copies between host memory and the device
    that nothing covers, from formulas too (jaxpar.plan.layouts.host_traffic: the CPU
    backend's host copies are no-ops). The pipeline and microbatches are the layout's specs."""
    peak = hw.peak_tflops * 1e12
    optimizer = report.orthogonalize_flops  # Muon's iteration: once a step, after the pipeline's ticks
    compute = (report.flops - optimizer) / hw.matmul_flops_per_s(config.train.compute_dtype)
    optimizer_s = optimizer / hw.matmul_flops_per_s(config.optim.ns_dtype)
    memory = hbm_bytes / (hw.hbm_gb_per_s * 1e9)
    widened = config.train.compute_dtype == "bfloat16"
    data_s = model_s = 0.0
    groups = config.parallel.diloco.inner_steps > 0
    for c in report.collectives:
        size = c.bytes_per_step * (0.5 if widened and c.dtype == "f32" and MODEL_AXES & set(c.axes) else 1.0)
        link = hw.inter_host_gb_per_s if c.crosses_hosts else hw.intra_host_gb_per_s
        seconds = size / ((hw.group_link_gb_per_s if hw.group_link_gb_per_s and "data" in c.axes else link) * 1e9)
        if MODEL_AXES & set(c.axes) or "stage" in c.axes or (groups and "data" in c.axes):  # DiLoCo's: unhidden
            model_s += seconds
        else:
            data_s += seconds
    bubble = pipeline_bubble(config, layout.pipeline, report.mesh.get("stage", 1), layout.microbatches)
    busy = max(compute, memory) / (1 - bubble) + optimizer_s
    # overlap hides the data-parallel collectives behind compute, no more than it lasts (as the estimate)
    exposed = data_s - min(hw.overlap_data * data_s, busy) + (1 - hw.overlap_model) * model_s + host_s
    step = busy + exposed
    tokens = config.train.global_batch * config.train.seq_len
    model_flops = config.model.flops_per_token(config.train.seq_len) * tokens / report.num_devices
    return {"step_s": step, "compute_s": compute + optimizer_s, "memory_s": memory, "data_comm_s": data_s, "model_comm_s": model_s,
            "exposed_comm_s": exposed, "bubble": bubble, "tokens_per_s_per_device": tokens / report.num_devices / step,
            "mfu": model_flops / (peak * step)}


def pipeline_bubble(config, pipeline, p: int, m: int) -> float:
    """The share of a pipelined step above the mean device's work: 1 - ideal / cost of the
    lockstep ticks (jaxpar.pipeline.lockstep) for the split `pipeline` gives; 0 without stages."""
    if p == 1:
        return 0.0
    model, seq_len = config.model, config.train.seq_len
    split = stage_split(model, pipeline, p, seq_len)
    cost, ideal = lockstep_cost(pipeline.schedule, p, m, pipeline.chunks, split.whole_model(leading_layers(model)),
                                0.0, head_layers(model, seq_len))
    return 1 - ideal / cost
