"""The layouts the planner considers, and a quick estimate of each from formulas alone
(memory per device, step time), so that only the promising ones are compiled."""

from __future__ import annotations

import collections
import dataclasses
import math

import jax.numpy as jnp

from jaxpar.config import OptimConfig
from jaxpar.specs import DilocoConfig
from jaxpar.step.diloco import outer_bytes
from jaxpar.inspect import formulas
from jaxpar.kernels.newton_schulz import MatrixAxes, flops
from jaxpar.kernels.experts.exchange import two_hops
from jaxpar.model import declared
from jaxpar.nn import RECOMPUTES_ATTENTION
from jaxpar.pipeline.lockstep import lockstep_cost
from jaxpar.pipeline.split import balanced_layers, compact, head_layers, leading_layers
from jaxpar.plan.presets import Hardware, tf32_share
from jaxpar.step.muon import model_matrices
from jaxpar.xla_options import layer_params

# full (each layer's input kept, its matmuls run again), dots (matmul outputs kept, the
# element-wise rest recomputed: jaxpar.nn) and none
REMATS = ("full", "dots", "none")


@dataclasses.dataclass(frozen=True)
class Layout:
    stage: int
    data: int
    fsdp: int
    tensor: int
    context: int
    expert: int
    zero_stage: int
    remat: str
    microbatches: int
    layers: tuple[int, ...] = ()  # whole-model layers per stage (stage > 1; () : balanced_layers' rule)
    leading: int = 0  # of layers[0], the model's leading ones (DeepSeek's dense layers)
    fp8_dispatch: bool = False  # parallel.expert_dispatch_dtype=fp8
    two_hops: bool = False  # model.group_capacity=true: a token crosses to a host once per group
    schedule: str = "1f1b"  # parallel.pipeline.schedule under stages: 1f1b | 1f1b-overlap
    optimizer: str = "adamw"  # optim.name: adamw | muon (priced by `muon_cost`)
    offload: bool = False  # parallel.zero.offload_params and offload_optimizer: the state rests on the host
    diloco: int = 0  # parallel.diloco.inner_steps: data's replicas are DiLoCo groups synchronised every this many steps

    @property
    def axes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in ("stage", "data", "fsdp", "expert", "context", "tensor")}

    def host_split(self, devices_per_host: int) -> dict[str, int]:
        """How many hosts each axis spans: the model-parallel axes fill a host first, then
        fsdp, data and stage, so the chattiest collectives stay on the fast links."""
        room, across = devices_per_host, {}
        for axis in ("tensor", "context", "expert", "fsdp", "data", "stage"):
            inside = math.gcd(self.axes[axis], room)
            room //= inside
            across[axis] = self.axes[axis] // inside
        return across

    def overrides(self, devices_per_host: int, hosts: int) -> list[str]:
        """The `--set` list that trains with this layout."""
        sets = [f"mesh.{a}={n}" for a, n in self.axes.items()]
        if hosts > 1:
            sets += [f"mesh.hosts.{a}={n}" for a, n in self.host_split(devices_per_host).items() if n > 1]
        sets += [f"parallel.zero.stage={self.zero_stage}", f"model.remat={self.remat}",
                 f"train.microbatches={self.microbatches}"] + ([f"optim.name={self.optimizer}"]
                                                              if self.optimizer != "adamw" else [])
        if self.tensor > 1:
            sets.append("parallel.tensor.sequence_parallel=true")
        if self.stage > 1:
            sets.append(f"parallel.pipeline.schedule={self.schedule}")
        if self.uneven:
            sets.append(f"parallel.pipeline.layers={compact(self.layers)}")
        if self.fp8_dispatch:
            sets.append("parallel.expert_dispatch_dtype=fp8")
        if self.two_hops:
            sets.append("model.group_capacity=true")
        if self.offload:
            sets += ["parallel.zero.offload_params=true", "parallel.zero.offload_optimizer=true"]
        if self.diloco:
            sets.append(f"parallel.diloco.inner_steps={self.diloco}")
        return sets

    @property
    def uneven(self) -> bool:
        """Whether the stages' layers differ from `balance=even`'s equal chunks (the leading
        layers aside), so that the overrides must list them."""
        return len({self.layers[0] - self.leading, *self.layers[1:]}) > 1 if self.layers else False

    def describe(self) -> str:
        shown = " ".join(f"{a}={n}" for a, n in self.axes.items() if n > 1) or "one device"
        layers = f" layers={compact(self.layers)}" if self.uneven else ""
        experts = " fp8-dispatch" * self.fp8_dispatch + " two-hops" * self.two_hops
        overlap = " overlapped" * (self.schedule == "1f1b-overlap")
        host = " state-on-host" * self.offload
        groups = f" diloco H={self.diloco}" if self.diloco else ""
        return (f"{shown} zero{self.zero_stage} remat={self.remat} m={self.microbatches}{overlap}{layers}{experts}{host}"
                f"{groups}")


def candidates(model, devices: int, devices_per_host: int, global_batch: int, seq_len: int) -> list[Layout]:
    """Every layout the framework can run for `model` on `devices`: tensor and context
    inside a host; experts over up to every device, across hosts if need be (DeepSeek-V3's
    EP 64 spans 8 hosts); up to 16 stages, each holding the balanced rule's layers
    (jaxpar.pipeline.split.balanced_layers; experts split inside them); fsdp x data filling the rest; ZeRO over
    data when there is one; remat full, dots and none; microbatches from 1 (p..4p under a pipeline,
    each with 1F1B and with 1F1B's forwards beside its backwards). Tensor need not divide the key/value
    heads: they are repeated at use (jaxpar.step.layout.kv_repeats). Experts across hosts
    also with the FP8 dispatch, and, for capacity routing with groups the hosts hold whole,
    with group capacity (the two-hop exchange: `expert_variants`). Without stages, each also
    with the parameters, master and optimizer state resting on the host (`offload`)."""
    heads = model.num_heads  # key/value heads tensor does not divide are repeated at use (kv_repeats)
    experts = declared(model, "num_experts")
    leading = leading_layers(model)
    splits = {p: _or_none(balanced_layers, model, p, seq_len) for p in _divisors(devices)
              if 1 < p <= min(16, model.num_layers + leading)}
    out = []
    for tensor in _divisors(devices_per_host):
        if heads % tensor or model.vocab_size % tensor or model.mlp % tensor:
            continue
        for context in ([1, 2, 4] if seq_len >= 16384 else [1]):
            for expert in (_divisors(experts) if experts else [1]):
                inner = tensor * context * expert
                if tensor * context > devices_per_host or devices % inner or seq_len % (context * tensor * 2):
                    continue
                if expert > devices_per_host and expert % devices_per_host:  # whole hosts of experts
                    continue
                stages = [1] if context > 1 else [p for p in _divisors(devices // inner) if p == 1 or splits.get(p)]
                for stage in stages:
                    rest = devices // (inner * stage)
                    for fsdp in _divisors(rest):
                        data = rest // fsdp
                        if model.embed % fsdp:
                            continue
                        for zero in ([1] if data == 1 or stage > 1 else [1, 3]) if data > 1 else [0]:
                            for remat in REMATS:
                                for m in ([stage, 2 * stage, 4 * stage] if stage > 1 else [1, 2, 4]):
                                    if global_batch % (data * fsdp * expert * m):
                                        continue
                                    for schedule in ("1f1b", "1f1b-overlap") if stage > 1 else ("1f1b",):
                                        for offload in (False, True) if stage == 1 else (False,):
                                            plain = Layout(stage, data, fsdp, tensor, context, expert, zero, remat, m,
                                                           splits.get(stage) or (), leading, schedule=schedule,
                                                           offload=offload)
                                            out += expert_variants(plain, model, devices_per_host)
    return out


def diloco_variants(layouts: list[Layout], inner_steps: int) -> list[Layout]:
    """`layouts`, and each that DiLoCo can run with its data replicas as groups (data > 1,
    no stages, the state on the device: jaxpar.checks.diloco) once more with DiLoCo
    synchronising every `inner_steps` (0: none), without ZeRO over data (each group holds
    its own state)."""
    if not inner_steps:
        return layouts
    able = [lay for lay in layouts if lay.data > 1 and lay.stage == 1 and not lay.offload]
    grouped = dict.fromkeys(dataclasses.replace(lay, diloco=inner_steps, zero_stage=0) for lay in able)
    return layouts + list(grouped)


def expert_variants(layout: Layout, model, devices_per_host: int) -> list[Layout]:
    """`layout`, and where its experts span hosts, the same with the FP8 dispatch and (capacity
    routing whose groups the expert axis's hosts hold whole) with group capacity."""
    hosts = layout.host_split(devices_per_host)["expert"]
    if hosts == 1:
        return [layout]
    groups = declared(model, "expert_groups")
    hops = [False, True] if model.routing == "capacity" and groups > 1 and two_hops(("expert",), hosts, groups) else [False]
    return [dataclasses.replace(layout, fp8_dispatch=f, two_hops=t) for f in (False, True) for t in hops]


def _or_none(fn, *args):
    try:
        return fn(*args)
    except ValueError:  # too few layers for the stages
        return None


def estimate(layout: Layout, model, global_batch: int, seq_len: int, hw: Hardware) -> dict[str, float]:
    """Memory per device (bytes) and step time (s) from formulas: model state (ZeRO),
    activations (Korthikanti et al.), logits; compute at the matmul efficiency, collective
    bytes over their links, less what overlaps, the compute stretched by the pipeline's
    lockstep ticks (jaxpar.pipeline.lockstep). The busiest stage's layers count for memory."""
    L, leading = layout, leading_layers(model)
    counts = (L.layers or balanced_layers(model, L.stage, seq_len)) if L.stage > 1 else (model.num_layers + leading,)
    rows = max((counts[0] - leading, *counts[1:]))  # the stack's rows a stage holds (each padded to the widest)
    psi_local, routed = _stage_params(model, rows)
    experts = declared(model, "num_experts")
    devices = math.prod(L.axes.values())
    muon = muon_cost(model, L) if L.optimizer == "muon" else None
    moments = 8 if muon is None else muon["state_bytes"]  # bytes of optimizer state a parameter
    dense = formulas.model_state(psi_local - routed, L.zero_stage, L.data, L.fsdp * L.tensor, 2, moments)
    experts_state = formulas.model_state(routed, L.zero_stage, L.data, L.fsdp * L.tensor * L.expert, 2, moments)
    # the gradients accumulate in float32 over microbatches (as explain's model_state counts them)
    grads = (dense.grads + experts_state.grads) * (1 + (L.microbatches > 1))
    state = dense.total + experts_state.total - dense.grads - experts_state.grads + grads
    host = host_traffic(dense, experts_state, L) if L.offload else None
    if host is not None:  # on the device: the gradients, and one layer's weights fetched at a time
        state = grads + 2 * layer_params(model) / L.tensor
    local = (psi_local - routed) / (L.fsdp * L.tensor) + routed / (L.fsdp * L.tensor * L.expert)  # elements a device holds
    state += 8 * local if L.diloco else 0.0  # DiLoCo's anchor and outer momentum, float32
    b = global_batch // (L.data * L.fsdp * L.expert * L.microbatches)  # rows per device per microbatch
    s, h, a = seq_len // L.context, model.embed, model.num_heads
    layers = max(counts)
    full = formulas.activation_bytes_per_layer(s, b, h, a, L.tensor, sequence_parallel=L.tensor > 1)
    kept = 2 * s * b * h / L.tensor  # a layer's input, sequence parallel
    per_layer = full if L.remat == "none" else kept if L.remat == "full" else _matmul_outputs(model, s, b, L)
    if L.stage > 1:  # stage-level recomputation: chunk inputs in flight (overlapped: 2p - 1), one chunk live
        in_flight = 2 * L.stage - 1 if L.schedule == "1f1b-overlap" else L.stage
        activations = in_flight * kept + layers * per_layer + full
    else:  # under remat, one layer's whole activations live while it is recomputed
        activations = layers * per_layer + (full if L.remat != "none" else 0)
    logits = 3 * 4 * s * b * model.vocab_size / L.tensor  # fp32 logits, their softmax and gradient
    memory = state + activations + logits
    # HBM traffic: each layer's gathered weights read in the forward, the recomputed forward
    # and both backward matmuls, per microbatch; the activations written once and read
    # once; the optimizer reading and writing its state, master weights and gradients; over
    # several microbatches, each one's gradients added to the float32 sum (read and written:
    # 4x the bf16 weights' bytes a microbatch; DeepSeek-V3's compiled 2,048-GPU plan spent
    # most of its step there).
    weights = 2 * ((psi_local - routed) / L.tensor + routed / (L.tensor * L.expert))
    passes = 4 if L.remat == "full" else 3  # full runs each layer's matmuls again
    accumulate = 4 * weights * L.microbatches if L.microbatches > 1 else 0.0
    hbm = passes * weights * L.microbatches + 2 * activations * L.microbatches + 2 * state + accumulate

    tokens = global_batch * seq_len
    recompute = 4 / 3 if L.remat == "full" else 1.0
    compute = model.flops_per_token(seq_len) * tokens / devices * recompute / (hw.peak_tflops * 1e12 * hw.matmul_efficiency)
    bubble = 0.0  # the share of the lockstep step above the mean device's work
    if L.stage > 1:
        cost, ideal = lockstep_cost(L.schedule, L.stage, L.microbatches, 1, counts, 0.0, head_layers(model, seq_len))
        bubble = 1 - ideal / cost
    across = L.host_split(hw.devices_per_host)
    def bw(axis: str) -> float:
        if axis == "data" and hw.group_link_gb_per_s:  # data's replicas in different clusters
            return hw.group_link_gb_per_s * 1e9
        return (hw.inter_host_gb_per_s if across[axis] > 1 else hw.intra_host_gb_per_s) * 1e9
    shard = weights / 2  # the parameters a device reduces and gathers: experts split e ways besides
    fsdp_bytes = 3 * 2 * shard * (L.fsdp - 1) / L.fsdp * L.microbatches if L.fsdp > 1 else 0.0
    data_bytes = (3 if L.zero_stage >= 3 else 2) * 4 * shard / L.fsdp * (L.data - 1) / L.data if L.data > 1 else 0.0
    if L.zero_stage >= 3 and L.data > 1:  # gathered and reduced over data x fsdp at once: every byte at data's link
        joint = L.data * L.fsdp  # (as the compiled roofline charges one collective over both axes)
        fsdp_bytes, data_bytes = 0.0, 3 * 2 * shard * (joint - 1) / joint * L.microbatches
    outer = outer_bytes(DilocoConfig(inner_steps=L.diloco), local, L.data) if L.diloco else 0.0
    data_bytes = 0.0 if L.diloco else data_bytes  # DiLoCo: no gradient crosses between groups, its exchange does
    # 8 collectives a layer (forward and backward: 2 gathers into the column projections, 2
    # reductions out of the row ones, each way); under full as many more as its compute (4/3),
    # under dots the 2 gathers of the norms it recomputes
    again = {"none": 1.0, "dots": 10 / 8, "full": 4 / 3}[L.remat]
    tensor_bytes = 8 * layers * 2 * s * b * h * (L.tensor - 1) / L.tensor * L.microbatches * again
    data_time = fsdp_bytes / bw("fsdp") + data_bytes / bw("data")
    host_link = hw.host_link_gb_per_s * 1e9
    data_time += host["streamed"] / host_link if host else 0.0  # prefetched beside the layers, as the gathers
    model_time = tensor_bytes / bw("tensor") if L.tensor > 1 else 0.0
    if experts and L.expert > 1:
        model_time += _expert_seconds(L, model, s * b, rows, bw("expert"), hw.intra_host_gb_per_s * 1e9)
    busy = compute / (1 - bubble)
    hidden = min(hw.overlap_data * data_time, busy)  # overlap hides collectives behind compute, no more than it lasts
    step = busy + data_time - hidden + (1 - hw.overlap_model) * model_time + outer / bw("data")  # DiLoCo's: unhidden
    host_s = (1 - hw.overlap_data) * host["streamed"] / host_link + host["update"] / host_link if host else 0.0
    step += host["update"] / host_link if host else 0.0  # at the step's edge, after the backward: nothing covers it
    if muon is not None:  # its exchange runs beside other matrices' iterations (docs/muon.md: all covered)
        slowest = min(bw(a) for a, n in L.axes.items() if n > 1) if devices > 1 else float("inf")
        step += max(muon["flops"] / (hw.peak_tflops * 1e12 * hw.matmul_efficiency * muon["rate"]),
                    muon["exchanged_bytes"] / slowest)
    step = max(step, hbm / (hw.hbm_gb_per_s * 1e9))
    return {"memory": memory, "hbm_bytes": hbm, "accumulate_bytes": accumulate, "step_s": step, "compute_s": compute,
            "bubble": bubble, "host_bytes": host["streamed"] + host["update"] if host else 0.0, "host_s": host_s}


def host_traffic(dense, experts, L: Layout) -> dict[str, float]:
    """Bytes a device copies between host memory and itself in a step, with its parameters,
    master and optimizer state resting on the host (jaxpar.sharding's ParamGather.from_host,
    jaxpar.step.state.on_device): `streamed`, each use's fetch of its parameter shards (the
    forward, the backward, and the recomputed forward under remat, every microbatch) and each
    microbatch's gradients sent to the host and brought back; `update`, the master and the
    optimizer state fetched and returned, and the new parameters returned."""
    params = dense.params + experts.params
    uses = (3 if L.remat == "full" else 2) * L.microbatches  # dots keeps the matmuls' outputs
    streamed = params * uses + 2 * (dense.grads + experts.grads) * L.microbatches
    update = 2 * (dense.master + experts.master + dense.optimizer + experts.optimizer) + params
    return {"streamed": streamed, "update": update}


def muon_cost(model, L: Layout) -> dict[str, float]:
    """Muon's price per device (jaxpar.step.muon, at OptimConfig's settings, which the
    compiled candidates train with): its optimizer state, a float32 momentum for each matrix
    and AdamW's two moments for the rest, in bytes a parameter; and the matrices a device
    orthogonalises and sends whole and back, as the kernel spreads them
    (jaxpar.kernels.newton_schulz): parameters whose matrices are cut alike joined into one
    stack, a stage's (an expert's) share of it padded to a multiple of the devices sharing it."""
    optim, devices = OptimConfig(), math.prod(L.axes.values())
    matrices = model_matrices(model)
    elements = sum(math.prod(shape) for shape, _, _ in matrices)
    # (matrix dims, row dims, their logical names, split) -> matrices: names stand for how the
    # layout cuts them (the kernel joins stacks whose pieces match: share_key)
    stacks: dict[tuple, int] = collections.defaultdict(int)
    for shape, axes, names in matrices:
        split = (L.stage if "layers" in names else 1) * (L.expert if "experts" in names else 1)
        sides = axes.rows + axes.cols
        key = (tuple(shape[d] for d in sides), len(axes.rows), tuple(names[d] for d in sides), split)
        stacks[key] += -(-axes.count(shape) // split)
    work = sent = 0.0
    for (dims, rows, _, split), stack in stacks.items():
        mine = -(-stack // (devices // split))  # ceil(the stage's stack / its sharers)
        one = MatrixAxes((), tuple(range(rows)), tuple(range(rows, len(dims))))
        work += mine * flops(dims, one, optim.ns_steps)
        sent += 2 * jnp.dtype(optim.ns_dtype).itemsize * mine * math.prod(dims)
    share = min(1.0, elements / model.param_count())
    rate = tf32_share(optim.ns_dtype)  # float32 iterations multiply as TF32
    return {"state_bytes": 4 * share + 8 * (1 - share), "flops": work, "rate": rate, "exchanged_bytes": sent}


def _expert_seconds(L: Layout, model, tokens: int, rows: int, bandwidth: float, intra_host: float) -> float:
    """The all-to-alls' time per step: 4 a layer and microbatch (6 recomputed), bf16; the
    dispatches (1 of them, 2 recomputed) at 1 + 4/128 bytes an element with the FP8 dispatch.
    With two hops a token crosses hosts top_groups / k as often, and its k copies then move
    inside the host, over NVLink."""
    factor = _capacity_factor(model)
    passes, dispatches = (6, 2) if L.remat in RECOMPUTES_ATTENTION else (4, 1)  # dots keeps what they deliver
    pass_bytes = passes - dispatches * (1 - formulas.FP8_PAYLOAD_BYTES / 2) if L.fp8_dispatch else passes
    elements = formulas.expert_traffic_elements(tokens, model.top_k, model.embed, factor) * rows * L.microbatches
    moved = 2 * elements * pass_bytes * (L.expert - 1) / L.expert
    if not L.two_hops:
        return moved / bandwidth
    return moved * declared(model, "top_groups") / model.top_k / bandwidth + moved / intra_host


def _capacity_factor(model) -> float:
    """The slots an expert holds over its even share of tokens: capacity routing's factor, 1
    for dropless routing."""
    return model.capacity_factor if model.routing == "capacity" else 1.0


def _matmul_outputs(model, s: int, b: int, L: Layout) -> float:
    """What remat `dots` keeps of a layer (formulas.matmul_outputs_bytes_per_layer). Key and
    value heads tensor does not divide are repeated to t; values may be narrower than keys
    (v_head_dim: DeepSeek's). An MoE layer keeps its top-k experts' gate and up outputs
    (over the capacity factor) and the shared experts', and each routed copy's output, twice
    over expert parallelism (the all-to-alls' buffers, EXCHANGED_NAME); DeepSeek's latents
    are not counted."""
    t, head, value = L.tensor, model.head_dim, declared(model, "v_head_dim") or model.head_dim
    kv = max(model.num_kv_heads, t)
    attention = model.num_heads * (head + value) + kv * (head + value)
    mlp = 2 * model.mlp
    if declared(model, "num_experts"):
        routed = model.top_k * _capacity_factor(model)
        mlp = 2 * model.mlp * (routed + model.shared_experts) + routed * model.embed * (2 if L.expert > 1 else 1)
    return formulas.matmul_outputs_bytes_per_layer(s, b, model.embed, attention, mlp, t, t > 1)


def _stage_params(model, rows: int) -> tuple[float, float]:
    """(a stage's parameters, the routed experts' among them): `rows` layers of the stack, and
    all that is outside it (embedding, head, final norm, DeepSeek's dense layers and
    prediction module), which every stage holds whole."""
    each = layer_params(model)
    experts = declared(model, "num_experts")
    routed = 3 * model.embed * model.mlp * experts * (rows + declared(model, "mtp_layers"))  # also over expert
    return model.param_count() - each * (model.num_layers - rows), routed


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
