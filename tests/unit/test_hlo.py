"""jaxpar.inspect.hlo on real CPU-compiled programs and on hand-written GPU-style HLO."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.inspect.hlo import collectives, dot_types, summarize

TWO_HOSTS = [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))


def _hlo(fn, mesh, spec, shape=(8, 16), dtype=jnp.float32, **jit_kw) -> str:
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    return jax.jit(fn, **jit_kw).lower(arg).compile().as_text()


def _smap(fn, mesh, in_spec, out_spec):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec)


def _only(colls, kind):
    found = [c for c in colls if c.kind == kind]
    assert len(found) == 1, colls
    return found[0]


# ---------------------------------------------------------------- real CPU programs


def test_all_gather_over_fsdp(mesh):
    text = _hlo(lambda a: a * 2, mesh, P("fsdp"), out_shardings=NamedSharding(mesh, P()))
    c = _only(collectives(text, mesh), "all-gather")
    assert c.axes == ("fsdp",) and c.group_size == 2 and c.dtype == "f32"
    assert c.groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    result_bytes = 8 * 16 * 4
    assert c.buffer_bytes == result_bytes
    assert c.link_bytes == result_bytes * (2 - 1) // 2
    assert c.trip_count == 1 and not c.is_async and not c.overlapped and c.crosses_hosts is None


def test_all_reduce_over_two_axes(mesh):
    text = _hlo(lambda a: a.sum(1), mesh, P(None, ("data", "tensor")), out_shardings=NamedSharding(mesh, P()))
    c = _only(collectives(text, mesh), "all-reduce")
    assert c.axes == ("data", "tensor") and c.group_size == 4
    assert c.buffer_bytes == 8 * 4 and c.link_bytes == 2 * 32 * 3 // 4


def test_reduce_scatter(mesh):
    rs = _smap(lambda a: jax.lax.psum_scatter(a, "fsdp", scatter_dimension=0, tiled=True), mesh, P(), P("fsdp"))
    c = _only(collectives(_hlo(rs, mesh, P()), mesh), "reduce-scatter")
    assert c.axes == ("fsdp",) and c.buffer_bytes == 8 * 16 * 4  # the operand, not the f32[4,16] result
    assert c.link_bytes == 8 * 16 * 4 // 2


def test_all_to_all(mesh):
    a2a = _smap(lambda a: jax.lax.all_to_all(a, "tensor", 0, 1, tiled=True), mesh, P("tensor"), P("tensor"))
    c = _only(collectives(_hlo(a2a, mesh, P()), mesh), "all-to-all")
    assert c.axes == ("tensor",) and c.group_size == 2
    assert c.buffer_bytes == 4 * 16 * 4 and c.link_bytes == c.buffer_bytes // 2  # tuple result summed


def test_collective_permute(mesh):
    pp = _smap(lambda a: jax.lax.ppermute(a, "data", [(0, 1), (1, 0)]), mesh, P("data"), P("data"))
    c = _only(collectives(_hlo(pp, mesh, P()), mesh), "collective-permute")
    assert c.axes == ("data",) and c.group_size == 2 and (0, 4) in c.groups
    assert c.link_bytes == c.buffer_bytes == 4 * 16 * 4


def test_scan_multiplies_by_trip_count(mesh):
    def body(c, _):
        return jax.lax.psum(c, "fsdp") * 0.5, None

    scan = _smap(lambda a: jax.lax.scan(body, a, None, length=5)[0], mesh, P(), P())
    c = _only(collectives(_hlo(scan, mesh, P()), mesh), "all-reduce")
    assert c.trip_count == 5 and c.trip_count_known and c.computation != "main.0_spmd"
    assert c.bytes_per_step == 5 * c.link_bytes


def test_nested_scans_multiply(mesh):
    def inner(c, _):
        return jax.lax.psum(c, "fsdp") * 0.5, None

    def outer(c, _):
        return jax.lax.scan(inner, c, None, length=3)[0] + 1, None

    nested = _smap(lambda a: jax.lax.scan(outer, a, None, length=4)[0], mesh, P(), P())
    c = _only(collectives(_hlo(nested, mesh, P()), mesh), "all-reduce")
    assert c.trip_count == 12 and c.bytes_per_step == 12 * c.link_bytes


def test_sub_axis_groups_map_to_their_axis():
    """XLA prints a group over part of an axis as `'b':(1)2`: pairs two apart along b."""
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    text = _hlo(lambda a: a.reshape(2, 4, 16).sum(0), m, P("b"), out_shardings=NamedSharding(m, P()))
    assert "'b':(1)2" in text
    ar = _only(collectives(text, m), "all-reduce")
    assert ar.groups == ((0, 2), (1, 3), (4, 6), (5, 7)) and ar.axes == ("b",)


def test_explicit_groups_from_axis_index_groups():
    m = Mesh(np.array(jax.devices()), ("x",))
    fn = jax.pmap(lambda a: jax.lax.psum(a, "i", axis_index_groups=[[0, 5], [1, 3], [4, 2], [6, 7]]), axis_name="i")
    text = fn.lower(np.ones((8, 4), np.float32)).compile().as_text()
    assert "replica_groups={{0,5}" in text
    c = _only(collectives(text, m, host_of=TWO_HOSTS), "all-reduce")
    assert c.groups == ((0, 5), (1, 3), (4, 2), (6, 7)) and c.crosses_hosts


def test_partition_ids_follow_mesh_flat_order():
    """Partition p runs on mesh.devices.flat[p], so axes come out right for a permuted mesh."""
    m = Mesh(np.array(jax.devices())[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4), ("a", "b"))
    for axis in ("a", "b"):
        spec = P(None, axis)
        compiled = jax.jit(lambda a: a.sum(1), out_shardings=NamedSharding(m, P())).lower(
            jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(m, spec))).compile()
        assert _only(collectives(compiled.as_text(), m), "all-reduce").axes == (axis,)
    assert [d.id for d in compiled.runtime_executable().local_devices()] == [d.id for d in m.devices.flat]

    # axis indices are computed from partition-id(); each device's value is its flat mesh position
    where = _smap(lambda x: x + 4 * jax.lax.axis_index("a") + jax.lax.axis_index("b"), m, P(("a", "b")), P(("a", "b")))
    fn = jax.jit(where)
    assert "partition-id()" in fn.lower(jnp.zeros(8, jnp.int32)).compile().as_text()
    flat = [d.id for d in m.devices.flat]
    for shard in fn(jnp.zeros(8, jnp.int32)).addressable_shards:
        assert int(shard.data[0]) == flat.index(shard.device.id)


def test_host_crossing(mesh):
    outer = _hlo(lambda a: a.sum(0), mesh, P("data"), out_shardings=NamedSharding(mesh, P()))
    inner = _hlo(lambda a: a.sum(0), mesh, P("tensor"), out_shardings=NamedSharding(mesh, P()))
    assert _only(collectives(outer, mesh, TWO_HOSTS), "all-reduce").crosses_hosts is True
    assert _only(collectives(inner, mesh, TWO_HOSTS), "all-reduce").crosses_hosts is False


def test_summarize_groups_and_sorts(mesh):
    def body(c, _):
        return jax.lax.psum(c, "fsdp") + jax.lax.psum(c * 2, "fsdp"), None

    fn = _smap(lambda a: jax.lax.all_gather(jax.lax.scan(body, a, None, length=3)[0], "tensor", tiled=True),
               mesh, P("tensor"), P("tensor"))
    colls = collectives(_hlo(fn, mesh, P("tensor")), mesh)
    rows = summarize(colls)
    assert [r["bytes_per_step"] for r in rows] == sorted((r["bytes_per_step"] for r in rows), reverse=True)
    assert sum(r["bytes_per_step"] for r in rows) == sum(c.bytes_per_step for c in colls)
    ar = next(r for r in rows if r["kind"] == "all-reduce")
    assert ar["axes"] == ("fsdp",) and ar["executions"] == 3 * ar["count"]


# ---------------------------------------------------------------- hand-written GPU-style HLO

GPU_HLO = """
HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[32,128]{1,0}, f32[64,128]{1,0}, f32[16]{0})->f32[]}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_negate (p: bf16[32,128]) -> bf16[32,128] {
  %p = bf16[32,128]{1,0} parameter(0)
  ROOT %n = bf16[32,128]{1,0} negate(%p)
}

%wrapped_reduce_scatter (a: f32[64,128]) -> f32[32,128] {
  %a = f32[64,128]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[32,128]{1,0} reduce-scatter(%a), channel_id=3, replica_groups=[4,2]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add
}

%wrapped_all_to_all (b: f32[16]) -> f32[16] {
  %b = f32[16]{0} parameter(0)
  ROOT %all-to-all.1 = f32[16]{0} all-to-all(%b), channel_id=4, replica_groups={}, dimensions={0}
}

ENTRY %main (p0: bf16[32,128], p1: f32[64,128], p2: f32[16]) -> f32[] {
  %p0 = bf16[32,128]{1,0} parameter(0)
  %p1 = f32[64,128]{1,0} parameter(1)
  %p2 = f32[16]{0} parameter(2)
  %all-gather-start = (bf16[32,128]{1,0}, bf16[64,128]{1,0}) all-gather-start(%p0), channel_id=1, replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}, use_global_device_ids=true, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":false,"no_parallel_custom_call":false},"force_earliest_schedule":false}
  %negate_fusion = bf16[32,128]{1,0} fusion(%p0), kind=kLoop, calls=%fused_negate
  %all-gather-done = bf16[64,128]{1,0} all-gather-done(%all-gather-start)
  %all-reduce-start = f32[16]{0} all-reduce-start(%p2), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":true,"no_parallel_custom_call":false}}
  %all-reduce-done = f32[16]{0} all-reduce-done(%all-reduce-start)
  %reduce-scatter-start = ((f32[64,128]{1,0}), f32[32,128]{1,0}) async-start(%p1), calls=%wrapped_reduce_scatter
  %bitcast.1 = f32[16]{0} bitcast(%all-reduce-done)
  %reduce-scatter-done = f32[32,128]{1,0} async-done(%reduce-scatter-start), calls=%wrapped_reduce_scatter
  %all-to-all-start = ((f32[16]{0}), f32[16]{0}) async-start(%bitcast.1), calls=%wrapped_all_to_all
  %negate_fusion.2 = bf16[32,128]{1,0} fusion(%negate_fusion), kind=kLoop, calls=%fused_negate
  %all-to-all-done = f32[16]{0} async-done(%all-to-all-start), calls=%wrapped_all_to_all
  %collective-permute-start = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%all-to-all-done), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %collective-permute-done = f32[16]{0} collective-permute-done(%collective-permute-start)
  ROOT %r = f32[] constant(0)
}
"""


def _by_kind(text, mesh, **kw):
    return {c.kind: c for c in collectives(text, mesh, **kw)}


def test_gpu_async_pairs_counted_once(mesh):
    colls = collectives(GPU_HLO, mesh)
    assert sorted(c.kind for c in colls) == sorted(
        ["all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"])
    assert all(c.is_async and c.computation == "main" for c in colls)
    by = {c.kind: c for c in colls}
    assert by["reduce-scatter"].name == "reduce-scatter-start"  # the wrapper is not scanned again


def test_gpu_async_overlap(mesh):
    by = _by_kind(GPU_HLO, mesh)
    assert by["all-gather"].overlapped  # a fusion between start and done
    assert by["all-to-all"].overlapped
    assert not by["all-reduce"].overlapped  # start immediately followed by done
    assert not by["reduce-scatter"].overlapped  # only a bitcast in between
    assert not by["collective-permute"].overlapped


def test_gpu_groups_and_bytes(mesh):
    by = _by_kind(GPU_HLO, mesh, host_of=TWO_HOSTS)
    ag = by["all-gather"]
    assert ag.groups == ((0, 2), (1, 3), (4, 6), (5, 7)) and ag.axes == ("fsdp",)
    assert ag.dtype == "bf16" and ag.buffer_bytes == 64 * 128 * 2 and ag.link_bytes == 64 * 128
    rs = by["reduce-scatter"]
    assert rs.groups == ((0, 1), (2, 3), (4, 5), (6, 7)) and rs.axes == ("tensor",)
    assert rs.buffer_bytes == 64 * 128 * 4 and rs.link_bytes == 64 * 128 * 2
    ar = by["all-reduce"]
    assert ar.axes == ("data",) and ar.crosses_hosts and ar.link_bytes == 64
    a2a = by["all-to-all"]
    assert a2a.group_size == 8 and a2a.axes == ("data", "fsdp", "tensor")
    cp = by["collective-permute"]
    assert cp.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and cp.group_size == 4
    assert cp.axes == ("fsdp", "tensor") and not cp.crosses_hosts and cp.link_bytes == 64


SUGAR_AND_LOOPS_HLO = """
HloModule m, is_scheduled=true, num_partitions=8

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

body {
  bp = (s32[], f32[8]) parameter(0)
  bx = f32[8]{0} get-tuple-element(bp), index=1
  ags = (f32[8]{0}, f32[16]{0}) all-gather-start(bx), channel_id=1, replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'data'}, dimensions={0}
  agd = f32[16]{0} all-gather-done(ags)
  ROOT bt = (s32[], f32[8]) tuple(gte, bx)
}

cond {
  cp = (s32[], f32[8]) parameter(0)
  ROOT lt = pred[] constant(true)
}

unknown_body {
  up = (s32[], s4[8]) parameter(0)
  ux = s4[8]{0} get-tuple-element(up), index=1
  uar = s4[8]{0} all-reduce(ux), replica_groups={}, to_apply=add
  ROOT ut = (s32[], s4[8]) tuple(gte, uar)
}

branch_true {
  tp = f32[] parameter(0)
  ROOT tar = f32[] all-reduce(tp), channel_id=9, replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'tensor'}, use_global_device_ids=true, to_apply=add
}

branch_false {
  fp = f32[] parameter(0)
  ROOT fn = f32[] negate(fp)
}

called {
  cp0 = f32[4]{0} parameter(0)
  ROOT cw = (s32[], f32[8]) while(init), condition=cond, body=body, backend_config={"known_trip_count":{"n":"7"}}
}

ENTRY main {
  p = f32[20]{0} parameter(0)
  rss = ((f32[20]{0}), f32[10]{0}) reduce-scatter-start(p), async_execution_thread="parallel_thread", channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, to_apply=add
  rsu = ((f32[20]{0}), f32[10]{0}) reduce-scatter-update(rss)
  conv = f32[20]{0} convolution(p, p), dim_labels=b0f_0io->b0f
  rsd = f32[10]{0}reduce-scatter-done(rsu)
  c = (s32[], f32[8]) call(p), to_apply=called
  w2 = (s32[], s4[8]) while(init2), condition=cond, body=unknown_body
  pred0 = pred[] constant(true)
  k = f32[] conditional(pred0, q, q), true_computation=branch_true, false_computation=branch_false
  ROOT r = f32[10]{0} copy(rsd)
}
"""


def test_sugared_async_update_and_call_graph(mesh):
    by = _by_kind(SUGAR_AND_LOOPS_HLO, mesh)
    rs = by["reduce-scatter"]
    assert rs.is_async and rs.overlapped and rs.trip_count == 1  # convolution between start and done
    assert rs.buffer_bytes == 80 and rs.axes == ("tensor",)
    ag = by["all-gather"]  # in a while body (trip count 7) reached through a call
    assert ag.trip_count == 7 and ag.trip_count_known and ag.axes == ("data",) and not ag.overlapped
    assert ag.bytes_per_step == 7 * 64 * 1 // 2
    ar = [c for c in collectives(SUGAR_AND_LOOPS_HLO, mesh) if c.kind == "all-reduce"]
    unknown = next(c for c in ar if c.dtype == "s4")
    assert unknown.trip_count == 1 and not unknown.trip_count_known
    assert unknown.buffer_bytes == 4 and unknown.group_size == 8  # s4[8] packs into 4 bytes; {} = all
    scalar = next(c for c in ar if c.dtype == "f32")
    assert scalar.computation == "branch_true" and scalar.buffer_bytes == 4 and scalar.axes == ("tensor",)


def test_mesh_form_with_device_ids():
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    text = textwrap.dedent("""
        HloModule m, num_partitions=8

        ENTRY main {
          p = f32[4]{0} parameter(0)
          ROOT ar = f32[4]{0} all-reduce(p), replica_groups=mesh['u'=4,'v'=2], device_ids=(0,4,1,5,2,6,3,7) {'u'}, to_apply=add
        }
    """)
    c = _only(collectives(text, m), "all-reduce")
    assert c.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and c.axes == ("b",)


GPU_GEMMS = textwrap.dedent("""\
    HloModule gemms, entry_computation_layout={(f8e4m3fn[64,32]{1,0}, f8e4m3fn[32,16]{1,0})->bf16[64,16]{1,0}}

    %widened_gemm (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,16]) -> bf16[64,16] {
      %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
      %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
      %c0 = bf16[64,32]{1,0} convert(f8e4m3fn[64,32]{1,0} %p0)
      %c1 = bf16[32,16]{1,0} convert(f8e4m3fn[32,16]{1,0} %p1)
      ROOT %dot.1 = bf16[64,16]{1,0} dot(bf16[64,32]{1,0} %c0, bf16[32,16]{1,0} %c1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    }

    ENTRY %main (a: f8e4m3fn[64,32], b: f8e4m3fn[32,16]) -> bf16[64,16] {
      %a = f8e4m3fn[64,32]{1,0} parameter(0)
      %b = f8e4m3fn[32,16]{1,0} parameter(1)
      %one = f32[] constant(1)
      %gemm_fusion = bf16[64,16]{1,0} fusion(f8e4m3fn[64,32]{1,0} %a, f8e4m3fn[32,16]{1,0} %b), kind=kCustom, calls=%widened_gemm
      %cublas = (bf16[64,16]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[64,32]{1,0} %a, f8e4m3fn[32,16]{1,0} %b, f32[] %one, f32[] %one), custom_call_target="__cublas$lt$matmul$f8"
      ROOT %out = bf16[64,16]{1,0} get-tuple-element((bf16[64,16]{1,0}, s8[33554432]{0}) %cublas), index=0
    }
    """)


def test_gemms_are_counted_by_what_their_multiply_reads():
    """A GEMM fusion whose parameters are FP8 but which widens them to bf16 before its dot is
    a bf16 GEMM (counting the fusion's parameter types called it FP8); a cuBLAS FP8 call
    is FP8 by its matrix operands, its scales left out."""
    assert dot_types(GPU_GEMMS) == {"bf16 x bf16": 1, "f8e4m3fn x f8e4m3fn": 1}


def test_a_combined_gather_is_typed_by_what_holds_its_bytes(mesh):
    """XLA combines a layer's gathers into one: FP8 weights with a bf16 norm scale first.
    The collective is an FP8 gather (the type holding most bytes), not a bf16 one."""
    text = textwrap.dedent("""\
        HloModule m

        ENTRY %main (n: bf16[32], w: f8e4m3fn[32,256]) -> (bf16[64], f8e4m3fn[64,256]) {
          %n = bf16[32]{0} parameter(0)
          %w = f8e4m3fn[32,256]{1,0} parameter(1)
          ROOT %ag = (bf16[64]{0}, f8e4m3fn[64,256]{1,0}) all-gather(%n, %w), channel_id=1, replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}, use_global_device_ids=true
        }
        """)
    c = _only(collectives(text, mesh), "all-gather")
    assert c.dtype == "f8e4m3fn" and c.buffer_bytes == 64 * 2 + 64 * 256
