"""jaxpar.inspect.cost on a hand-written GPU program, every figure worked out by hand: a layer
loop of 4 trips whose fusion slices one layer out of a stacked weight, a GEMM inside it, a
cuDNN attention call, and an update written in place into a stacked buffer."""

import dataclasses

import pytest

from jaxpar.inspect.cost import GpuCost, step_cost

HLO = """HloModule m

%gemm_body (p0: bf16[64,128], p1: bf16[4,128,256], i: s32[]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[4,128,256]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %w = bf16[1,128,256]{2,1,0} dynamic-slice(%p1, %i, %z, %z), dynamic_slice_sizes={1,128,256}
  %w2 = bf16[128,256]{1,0} bitcast(%w)
  ROOT %d = bf16[64,256]{1,0} dot(%p0, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%store_body (acc: f32[4,64,256], x: bf16[64,256], i: s32[]) -> f32[4,64,256] {
  %acc = f32[4,64,256]{2,1,0} parameter(0)
  %x = bf16[64,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %c = f32[64,256]{1,0} convert(%x)
  %c3 = f32[1,64,256]{2,1,0} bitcast(%c)
  ROOT %u = f32[4,64,256]{2,1,0} dynamic-update-slice(%acc, %c3, %i, %z, %z)
}

%body (t: (s32[], bf16[64,128], bf16[4,128,256], f32[4,64,256])) -> (s32[], bf16[64,128], bf16[4,128,256], f32[4,64,256]) {
  %t = (s32[], bf16[64,128]{1,0}, bf16[4,128,256]{2,1,0}, f32[4,64,256]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[64,128]{1,0} get-tuple-element(%t), index=1
  %ws = bf16[4,128,256]{2,1,0} get-tuple-element(%t), index=2
  %acc = f32[4,64,256]{2,1,0} get-tuple-element(%t), index=3
  %g = bf16[64,256]{1,0} fusion(%x, %ws, %i), kind=kCustom, calls=%gemm_body
  %s = f32[4,64,256]{2,1,0} fusion(%acc, %g, %i), kind=kLoop, calls=%store_body
  ROOT %r = (s32[], bf16[64,128]{1,0}, bf16[4,128,256]{2,1,0}, f32[4,64,256]{2,1,0}) tuple(%i, %x, %ws, %s)
}

%cond (t: (s32[], bf16[64,128], bf16[4,128,256], f32[4,64,256])) -> pred[] {
  %t = (s32[], bf16[64,128]{1,0}, bf16[4,128,256]{2,1,0}, f32[4,64,256]{2,1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: bf16[64,128], ws: bf16[4,128,256], acc: f32[4,64,256], q: bf16[2,512,4,64], k: bf16[2,512,2,64], v: bf16[2,512,2,64]) -> (f32[4,64,256], bf16[2,4,512,64]) {
  %x = bf16[64,128]{1,0} parameter(0)
  %ws = bf16[4,128,256]{2,1,0} parameter(1)
  %acc = f32[4,64,256]{2,1,0} parameter(2)
  %q = bf16[2,512,4,64]{3,2,1,0} parameter(3)
  %k = bf16[2,512,2,64]{3,2,1,0} parameter(4)
  %v = bf16[2,512,2,64]{3,2,1,0} parameter(5)
  %zero = s32[] constant(0)
  %t = (s32[], bf16[64,128]{1,0}, bf16[4,128,256]{2,1,0}, f32[4,64,256]{2,1,0}) tuple(%zero, %x, %ws, %acc)
  %w = (s32[], bf16[64,128]{1,0}, bf16[4,128,256]{2,1,0}, f32[4,64,256]{2,1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %out = f32[4,64,256]{2,1,0} get-tuple-element(%w), index=3
  %a = (bf16[2,4,512,64]{3,1,2,0}, f32[2,4,512]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"mask_type": "CAUSAL"}}
  %o = bf16[2,4,512,64]{3,1,2,0} get-tuple-element(%a), index=0
  ROOT %r = (f32[4,64,256]{2,1,0}, bf16[2,4,512,64]{3,1,2,0}) tuple(%out, %o)
}
"""

GPU = GpuCost(bf16_tflops=1.0, hbm_gb_per_s=1000.0, gemm_efficiency=0.5, attention_efficiency=0.25,
              hbm_efficiency=1.0, launch_s=1e-6)


def test_each_kernel_costs_its_own_flops_or_bytes_and_loops_count_their_trips():
    cost = step_cost(HLO, GPU)
    kernels = {k.name: k for k in cost.kernels}
    assert set(kernels) == {"g", "s", "a"}  # views, plumbing, control flow launch nothing

    gemm = kernels["g"]  # one layer's weight read, not the stack: 64x128 + 128x256 in, 64x256 out, bf16
    assert (gemm.runs, gemm.kind) == (4, "gemm")
    assert gemm.flops == 2 * 64 * 256 * 128
    assert gemm.bytes == 2 * (64 * 128 + 128 * 256 + 64 * 256) + 4  # and the s32 index
    assert gemm.seconds == pytest.approx(max(gemm.flops / 0.5e12, gemm.bytes / 1e12) + 1e-6)

    store = kernels["s"]  # in place: reads the bf16 update, writes one f32 layer; the stack is neither
    assert (store.runs, store.kind, store.flops) == (4, "memory", 0)
    assert store.bytes == 2 * 64 * 256 + 4 * 64 * 256 + 4
    assert store.seconds == pytest.approx(store.bytes / 1e12 + 1e-6)

    attention = kernels["a"]  # causal: half of 4 b h s t d, at 25% of the peak
    assert attention.kind == "attention" and attention.flops == 0.5 * 4 * 2 * 4 * 512 * 512 * 64
    assert attention.seconds == pytest.approx(max(attention.flops / 0.25e12, attention.bytes / 1e12) + 1e-6)
    assert cost.seconds == pytest.approx(4 * gemm.seconds + 4 * store.seconds + attention.seconds)


def test_a_stack_lax_empty_allocates_launches_nothing():
    """compiler.uninitialised_stacks: the loop's stack comes from XLA's AllocateBuffer,
    which the runtime allocates without a kernel; a zero fill in its place is a kernel."""
    allocated = HLO.replace("%acc = f32[4,64,256]{2,1,0} parameter(2)",
                            '%acc = f32[4,64,256]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"')
    assert {k.name for k in step_cost(allocated, GPU).kernels} == {"g", "s", "a"}
    filled = HLO.replace("%acc = f32[4,64,256]{2,1,0} parameter(2)", "%acc = f32[4,64,256]{2,1,0} fusion(), "
                         "kind=kLoop, calls=%cond")  # any fusion launches
    assert "acc" in {k.name for k in step_cost(filled, GPU).kernels}


def test_the_fused_attention_backward_runs_at_its_own_rate():
    """2.5 times the forward's FLOPs (dQ, dK, dV, dP and the scores again), at the backward's
    efficiency: cuDNN's backward kernel reaches less of the peak than its forward."""
    backward = dataclasses.replace(GPU, attention_backward_efficiency=0.1)
    kernel = next(k for k in step_cost(HLO.replace('fmhaSoftmax"', 'fmhaSoftmaxBackward"'), backward).kernels
                  if k.name == "a")
    assert kernel.flops == 2.5 * 0.5 * 4 * 2 * 4 * 512 * 512 * 64
    assert kernel.seconds == pytest.approx(kernel.flops / 0.1e12 + 1e-6)


def test_a_gemm_runs_at_the_rate_of_what_it_multiplies():
    """bf16 at the bf16 peak, float32 at TF32's (XLA's default precision on Hopper), an
    8-bit operand at the FP8 peak: the same GEMM body with other element types."""
    rates = dataclasses.replace(GPU, tf32_tflops=0.5, fp8_tflops=2.0)

    def gemm(text):
        return next(k for k in step_cost(text, rates).kernels if k.name == "g")

    f32 = HLO.replace("p0: bf16[64,128], p1: bf16[4,128,256]", "p0: f32[64,128], p1: f32[4,128,256]").replace(
        "%p0 = bf16[64,128]", "%p0 = f32[64,128]").replace("%p1 = bf16[4,128,256]", "%p1 = f32[4,128,256]").replace(
        "%w = bf16[1,128,256]", "%w = f32[1,128,256]").replace("%w2 = bf16[128,256]", "%w2 = f32[128,256]")
    fp8 = HLO.replace("%w2 = bf16[128,256]", "%w2 = f8e4m3fn[128,256]")
    flops = 2 * 64 * 256 * 128
    assert gemm(HLO).seconds == pytest.approx(flops / 0.5e12 + 1e-6)
    assert gemm(f32).seconds == pytest.approx(flops / 0.25e12 + 1e-6)
    assert gemm(fp8).seconds == pytest.approx(flops / 1e12 + 1e-6)


def test_a_target_is_checked_before_anything_compiles(tmp_path):
    """`--target` (explain, plan) names a GpuTargetConfig file and needs JAX's CUDA plugin
    (the suite's environment has none): one line each, before any compile."""
    from jaxpar.deviceless import _installed, gpu_devices
    from jaxpar.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--target='missing.pbtxt' is not a file; give a GpuTargetConfig file"):
        gpu_devices("missing.pbtxt")
    if not _installed("jax_plugins.xla_cuda13"):
        target = tmp_path / "h100.pbtxt"
        target.write_text("gpu_device_info { }")
        with pytest.raises(ConfigError, match=r"pip install 'jax\[cuda13\]' \(no GPU needed\)"):
            gpu_devices(str(target))


def test_explain_prints_the_prediction_with_its_costliest_kernels():
    from jaxpar.inspect.rows import predicted_lines

    cost = step_cost(HLO, GPU)
    lines = predicted_lines({"gpu": GPU.describe(), **cost.to_json()})
    assert lines[0].startswith(f"predicted step on this GPU: {cost.seconds * 1e3:.1f} ms (attention ")
    assert "3 kernels" not in lines[0] and "9 kernels" in lines[0]  # 4 + 4 runs in the loop, 1 outside
    assert lines[2].split()[:2] == ["a", "attention"]  # the costliest first


# Two all-to-alls in flight one after the other, a copy (a memory-bound kernel) between them:
# the first is started before the copy, the second after it, both done at the end.
SCHEDULED = """HloModule s, is_scheduled=true

ENTRY %main (a: bf16[1024,1024], b: bf16[1024,1024], c: f32[1024,1024]) -> (bf16[1024,1024], bf16[1024,1024], f32[1024,1024]) {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %b = bf16[1024,1024]{1,0} parameter(1)
  %c = f32[1024,1024]{1,0} parameter(2)
  %s1 = ((bf16[1024,1024]{1,0}), bf16[1024,1024]{1,0}) all-to-all-start(%a), replica_groups={{0,1}}, dimensions={0}
  %m = f32[1024,1024]{1,0} copy(%c)
  %s2 = ((bf16[1024,1024]{1,0}), bf16[1024,1024]{1,0}) all-to-all-start(%b), replica_groups={{0,1}}, dimensions={0}
  %d1 = bf16[1024,1024]{1,0} all-to-all-done(%s1)
  %d2 = bf16[1024,1024]{1,0} all-to-all-done(%s2)
  ROOT %r = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}, f32[1024,1024]{1,0}) tuple(%d1, %d2, %m)
}
"""


def test_compute_between_start_and_done_covers_the_transfers_in_flight_first_started_first():
    """The copy moves 8 MiB at 1 TB/s (8.4 us + 1 us launch); each all-to-all sends 1 MiB of
    its 2 MiB to the other device at 0.1 TB/s (10.5 us). The copy runs while only the first
    is in flight: it covers 9.4 us of it; the second, started after, none."""
    from jaxpar.inspect.cost import collective_covers, covered_share, exposed_collective_seconds
    from jaxpar.inspect.hlo import Collective

    gpu = GpuCost(bf16_tflops=1.0, hbm_gb_per_s=1000.0, hbm_efficiency=1.0, launch_s=1e-6, link_gb_per_s=100.0)
    colls = [Collective(kind="all-to-all", name=n, computation="main", dtype="bf16", buffer_bytes=2 * 2**20,
                        group_size=2, groups=((0, 1),), axes=("expert",), trip_count=2.0, trip_count_known=True,
                        link_bytes=2**20, is_async=True, overlapped=True, crosses_hosts=False) for n in ("s1", "s2")]
    first, second = collective_covers(SCHEDULED, colls, gpu)
    transfer = 2**20 / 100e9
    copy = 2 * 4 * 2**20 / 1e12 + 1e-6
    assert first.transfer_s == pytest.approx(transfer) and first.covered_s == pytest.approx(copy)
    assert second.covered_s == 0.0
    assert exposed_collective_seconds([first, second]) == pytest.approx(2 * (2 * transfer - copy))
    assert covered_share([first, second])["share"] == pytest.approx(copy / (2 * transfer))


def test_an_all_to_all_across_hosts_sends_only_its_other_hosts_share_over_the_nic():
    """Four ranks on two hosts: 2 of a rank's 3 peers are away, their 2/3 of the bytes over the
    NIC while the third goes over NVLink; other collectives crossing hosts run at the NIC's rate."""
    from jaxpar.inspect.cost import transfer_seconds
    from jaxpar.inspect.hlo import Collective

    gpu = GpuCost(link_gb_per_s=400.0, inter_host_gb_per_s=50.0)
    a2a = Collective(kind="all-to-all", name="a", computation="main", dtype="bf16", buffer_bytes=4 * 2**20, group_size=4,
                     groups=((0, 1, 2, 3),), axes=("expert",), trip_count=1.0, trip_count_known=True,
                     link_bytes=3 * 2**20, is_async=True, overlapped=True, crosses_hosts=True)
    assert transfer_seconds(a2a, gpu, [0, 0, 1, 1]) == pytest.approx(2 * 2**20 / 50e9)
    assert transfer_seconds(a2a, gpu) == pytest.approx(3 * 2**20 / 50e9)  # no host map: all over the NIC
    reduce = Collective(**{**a2a.__dict__, "kind": "all-reduce"})
    assert transfer_seconds(reduce, gpu, [0, 0, 1, 1]) == pytest.approx(3 * 2**20 / 50e9)


VIEW_STORE = """HloModule v

%store (acc: f32[1,4,64,256], x: f32[1,64,256], i: s32[]) -> f32[4,64,256] {
  %acc = f32[1,4,64,256]{3,2,1,0} parameter(0)
  %x = f32[1,64,256]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %view = f32[4,64,256]{2,1,0} bitcast(%acc)
  ROOT %u = f32[4,64,256]{2,1,0} dynamic-update-slice(%view, %x, %i, %z, %z)
}

ENTRY %main (acc: f32[1,4,64,256], x: f32[1,64,256]) -> f32[4,64,256] {
  %acc = f32[1,4,64,256]{3,2,1,0} parameter(0)
  %x = f32[1,64,256]{2,1,0} parameter(1)
  %i = s32[] constant(1)
  ROOT %s = f32[4,64,256]{2,1,0} fusion(%acc, %x, %i), kind=kLoop, calls=%store
}
"""


def test_an_update_into_a_view_of_a_stacked_buffer_is_in_place():
    """A scanned layer's residual stacked in another layout: the fusion updates a bitcast of
    its parameter, which is still the buffer itself. It moves the update twice (read,
    written) and its index, not the stack (before: 4x the stack's 256 KiB counted)."""
    store = step_cost(VIEW_STORE, GPU).kernels[0]
    assert store.bytes == 2 * 4 * 64 * 256 + 4


VIEW_SLICE = """HloModule s

%take (i: s32[], stack: bf16[8,1,512,128]) -> bf16[128,1,512] {
  %stack = bf16[8,1,512,128]{3,2,1,0} parameter(1)
  %view = bf16[128,8,1,512]{3,2,1,0} bitcast(%stack)
  %z = s32[] constant(0)
  %i = s32[] parameter(0)
  ROOT %s = bf16[128,1,1,512]{3,2,1,0} dynamic-slice(%view, %z, %i, %z, %z), dynamic_slice_sizes={128,1,1,512}
}

ENTRY %main (i: s32[], stack: bf16[8,1,512,128]) -> bf16[128,1,1,512] {
  %i = s32[] parameter(0)
  %stack = bf16[8,1,512,128]{3,2,1,0} parameter(1)
  ROOT %f = bf16[128,1,1,512]{3,2,1,0} fusion(%i, %stack), kind=kLoop, calls=%take
}
"""


def test_a_slice_of_a_view_reads_the_slice():
    """A blockwise kernel's block taken out of another layout of its stack: the fusion slices
    a bitcast of its parameter and reads one block of eight (before: the whole stack)."""
    take = step_cost(VIEW_SLICE, GPU).kernels[0]
    assert take.bytes == 4 + 2 * 2 * 128 * 512  # the index; the block read and written


def test_explain_says_how_many_gemms_read_fp8():
    from jaxpar.inspect.traffic import fp8_lines

    assert fp8_lines({"bf16 x bf16": 56, "f8e4m3fn x f8e4m3fn": 45, "f8e4m3fn x f8e5m2": 24}) == [
        "  FP8 GEMMs: 69 of 125 matrix multiplies (45 f8e4m3fn x f8e4m3fn, 24 f8e4m3fn x f8e5m2)"]
    assert fp8_lines({"bf16 x bf16": 56}) == []


CUBLAS_IN_PLACE = """HloModule c

%dsf (stack: bf16[4,128,256], i: s32[], x: bf16[64,128]) -> (bf16[64,256], s8[1024]) {
  %stack = bf16[4,128,256]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[64,128]{1,0} parameter(2)
  %z = s32[] constant(0)
  %w = bf16[1,128,256]{2,1,0} dynamic-slice(%stack, %i, %z, %z), dynamic_slice_sizes={1,128,256}
  %w2 = bf16[128,256]{1,0} bitcast(%w)
  ROOT %g = (bf16[64,256]{1,0}, s8[1024]{0}) custom-call(%x, %w2), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
}

ENTRY %main (stack: bf16[4,128,256], x: bf16[64,128]) -> (bf16[64,256], s8[1024]) {
  %stack = bf16[4,128,256]{2,1,0} parameter(0)
  %x = bf16[64,128]{1,0} parameter(1)
  %i = s32[] constant(2)
  ROOT %f = (bf16[64,256]{1,0}, s8[1024]{0}) fusion(%stack, %i, %x), kind=kCustom, calls=%dsf, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_slice_fusion"}}}
}
"""


def test_a_cublas_call_inside_a_dynamic_slice_fusion_is_a_gemm_reading_one_layer():
    """XLA's dynamic-slice fusion (the GPU compiler makes one when cuBLAS multiplies a layer
    of a stacked buffer, Triton GEMMs off): its cuBLAS call's FLOPs at the GEMM rate, and
    the one layer it reads, not the stack (before: charged as memory-bound copying)."""
    kernel = step_cost(CUBLAS_IN_PLACE, GPU).kernels[0]
    assert (kernel.kind, kernel.flops) == ("gemm", 2 * 64 * 256 * 128)
    assert kernel.bytes < 2 * 4 * 128 * 256  # less than the stack alone
    assert kernel.seconds == pytest.approx(kernel.flops / 0.5e12 + 1e-6)


def test_a_gemm_nested_in_calls_or_reading_widened_operands_runs_at_its_multiply_s_rate():
    """The dot that decides the rate may sit a fusion deeper than the kernel (a GEMM fusion
    wrapped in another), and a fusion's float32 parameters converted to bf16 before its dot multiply as
    bf16, not as TF32."""
    rates = dataclasses.replace(GPU, tf32_tflops=0.25)
    flops = 2 * 64 * 256 * 128

    def seconds(text):
        return next(k for k in step_cost(text, rates).kernels if k.name == "g").seconds

    nested = """HloModule n

%inner (p: bf16[64,128], q: bf16[128,256]) -> bf16[64,256] {
  %p = bf16[64,128]{1,0} parameter(0)
  %q = bf16[128,256]{1,0} parameter(1)
  ROOT %d = bf16[64,256]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%outer (a: f32[64,128], b: f32[128,256]) -> bf16[64,256] {
  %a = f32[64,128]{1,0} parameter(0)
  %b = f32[128,256]{1,0} parameter(1)
  %a16 = bf16[64,128]{1,0} convert(%a)
  %b16 = bf16[128,256]{1,0} convert(%b)
  ROOT %c = bf16[64,256]{1,0} fusion(%a16, %b16), kind=kCustom, calls=%inner
}

ENTRY %main (x: f32[64,128], w: f32[128,256]) -> bf16[64,256] {
  %x = f32[64,128]{1,0} parameter(0)
  %w = f32[128,256]{1,0} parameter(1)
  ROOT %g = bf16[64,256]{1,0} fusion(%x, %w), kind=kCustom, calls=%outer
}
"""
    assert seconds(nested) == pytest.approx(flops / 0.5e12 + 1e-6)  # bf16, not its float32 operands' TF32
    widened = HLO.replace("p0: bf16[64,128], p1: bf16[4,128,256], i: s32[]) -> bf16[64,256]",
                          "p0: f32[64,128], p1: bf16[4,128,256], i: s32[]) -> bf16[64,256]", 1).replace(
        "%p0 = bf16[64,128]{1,0} parameter(0)\n  %p1",
        "%p0f = f32[64,128]{1,0} parameter(0)\n  %p0 = bf16[64,128]{1,0} convert(%p0f)\n  %p1", 1)
    assert "convert(%p0f)" in widened
    assert seconds(widened) == pytest.approx(flops / 0.5e12 + 1e-6)

