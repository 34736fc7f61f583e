"""The Hopper kernels run on CPU, in Mosaic GPU's interpret mode.

JAX >= 0.12 interprets a Mosaic GPU kernel on CPU: every block and
warpgroup, shared memory, barriers and TMA copies are simulated, memory
nobody wrote reads as NaN (outputs poisoned), and a happens-before race
detector watches shared memory and the TMA copies. So CI checks the kernels'
numerics and synchronisation (slots refilled only once read, barriers,
epilogue stores) without a GPU, against an f32 reference on random inputs.

What it cannot see, and the GPU suite (tests/gpu) still covers:
- The rings (D >= 2): the interpreter has no semaphores or remote refs, so
  only D = 1 runs here (no sends; the configs' send fields then only shape
  the schedule).
- wgmma runs synchronously, so a slot freed while a wgmma still reads it
  (run 48's race) goes unseen: the code before its fix passes here.
  tests/kernels/test_kernel_tracing.py checks every `wgmma_wait` instead.
JAX 0.10 (Python 3.11) has no GPU interpret mode: the file skips there.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from collective_matmul import kernels
from collective_matmul.kernels import configs
from collective_matmul import selection

from cm_test_utils import kernel_configs
from cm_test_utils import mesh_1d
from cm_test_utils import needs_interpret_mode
from cm_test_utils import normal
from cm_test_utils import pallas_mlp

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
pytestmark = needs_interpret_mode()

# bf16 products summed in f32 and rounded once to bf16: ~1.6e-3 relative.
TOLERANCE = 5e-3


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  """After a kernel raised, the interpreter must be reset before it runs
  another one (`InterpretGPUParams`' docstring)."""
  yield
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # pylint: disable=g-import-not-at-top
  gpu_callbacks.reset_gpu_interpret_mode_state()


def _interpreted(f):
  """Runs `f()` with every Mosaic GPU kernel it traces interpreted on CPU,
  races raising."""
  with plgpu.force_gpu_interpret_mode(
      plgpu.InterpretGPUParams(detect_races=True, on_race="raise")):
    return f()


def _run(kernel, config, a, b, **kw):
  """`kernel` on a one-device mesh (the whole problem, no ring)."""
  def call():
    with jax.set_mesh(mesh_1d(1)):
      return jax.jit(jax.shard_map(
          functools.partial(kernel, axis_name="x", config=config, **kw),
          in_specs=(P(), P()), out_specs=P(), check_vma=False))(a, b)
  return _interpreted(call)


def _check(out, a, b):
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all(), "unwritten (NaN) output elements"
  ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert err < TOLERANCE, err


def _operands(keys, m, k, n, dtype=jnp.bfloat16):
  return normal(keys(), (m, k), dtype), normal(keys(), (k, n), dtype)


# The canaries: the interpreter does catch what these tests rely on.

def _copy_kernel(wait_before_store):
  """Loads a block into shared memory by TMA and stores it back; without
  the barrier wait first, the store reads the slot the load still fills."""
  def body(x_ref, o_ref, smem, barrier):
    plgpu.copy_gmem_to_smem(x_ref, smem, barrier)
    if wait_before_store:
      plgpu.barrier_wait(barrier)
    plgpu.copy_smem_to_gmem(smem, o_ref)
    plgpu.wait_smem_to_gmem(0)
    if not wait_before_store:
      plgpu.barrier_wait(barrier)
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
      scratch_types=[plgpu.SMEM((64, 64), jnp.float32),
                     plgpu.Barrier(num_arrivals=1)])


def test_the_interpreter_detects_a_slot_read_before_its_load_landed():
  x = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64)
  out = _interpreted(lambda: jax.jit(_copy_kernel(True))(x))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
  with pytest.raises(Exception, match="RACE DETECTED"):
    _interpreted(lambda: jax.block_until_ready(
        jax.jit(_copy_kernel(False))(x)))


def test_the_interpreter_poisons_what_a_kernel_leaves_unwritten():
  def body(x_ref, o_ref):
    del x_ref, o_ref
  kernel = plgpu.kernel(body,
                        out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32))
  out = _interpreted(lambda: jax.jit(kernel)(jnp.ones((64, 64))))
  assert np.isnan(np.asarray(out)).all()


# The kernels. k = 320 gives 5 k steps of 64 (not a multiple of 3 or 4
# stages, so chained configs run `_OffsetChain`) and 3 of 128, padded.

@pytest.mark.parametrize("name", sorted(kernel_configs("all_gather")))
def test_all_gather_kernel_interpreted(name, keys):
  a, b = _operands(keys, 512, 320, 512)
  _check(_run(kernels.all_gather_lhs_matmul,
              kernel_configs("all_gather")[name], a, b), a, b)


@pytest.mark.parametrize("name", sorted(kernel_configs("reduce_scatter")))
def test_reduce_scatter_kernel_interpreted(name, keys):
  a, b = _operands(keys, 512, 320, 512)
  _check(_run(kernels.matmul_reduce_scatter,
              kernel_configs("reduce_scatter")[name], a, b), a, b)


CHAINED = [(pattern, name) for pattern in ("all_gather", "reduce_scatter")
           for name, config in sorted(kernel_configs(pattern).items())
           if config.chain_tiles]


@pytest.mark.parametrize("pattern,name", CHAINED,
                         ids=[f"{p}-{n}" for p, n in CHAINED])
def test_chained_tiles_run_several_tiles_per_block(pattern, name, keys,
                                                   monkeypatch):
  """On 132 blocks each of these small problems' tiles has a block of its
  own, so no pipeline is ever chained to a next tile's: here the kernels
  see 2 compute blocks (plus the senders), and each runs 4 tiles, the
  next one's first k blocks loaded under this one's last steps and
  epilogue, in JAX's pipeline and in `_OffsetChain` (5 k steps)."""
  config = kernel_configs(pattern)[name]
  blocks = 2 + getattr(config, "sender_sms", 0)
  monkeypatch.setattr(configs, "sm_count", lambda device=None: blocks)
  kernel = (kernels.all_gather_lhs_matmul if pattern == "all_gather" else
            kernels.matmul_reduce_scatter)
  a, b = _operands(keys, 512, 320, 512)
  _check(_run(kernel, config, a, b), a, b)


@pytest.mark.parametrize("kernel,config", [
    (kernels.all_gather_lhs_matmul, kernels.AllGatherConfig()),
    (kernels.all_gather_lhs_matmul,
     kernels.AllGatherConfig(tile_m=64, tile_n=256, wg_dimension="m")),
    (kernels.matmul_reduce_scatter, kernels.ReduceScatterConfig()),
], ids=["all_gather", "all_gather_wide", "reduce_scatter"])
def test_shapes_off_the_tiles(kernel, config, keys):
  """m and k padded; n's last column tile left to TMA (zeros read past n,
  the stores past it dropped): a wrong column there reads as NaN."""
  a, b = _operands(keys, 200, 136, 264)
  _check(_run(kernel, config, a, b), a, b)


@pytest.mark.parametrize("kernel,config", [
    (kernels.all_gather_lhs_matmul, kernels.AllGatherConfig()),
    (kernels.matmul_reduce_scatter, kernels.ReduceScatterConfig()),
], ids=["all_gather", "reduce_scatter"])
def test_float32_output_from_f16(kernel, config, keys):
  # Fewer stages, so the float32 epilogue fits (as `selection` does).
  config = config.fit_shared_memory(2, 4)  # f16 operands, f32 results.
  a, b = _operands(keys, 256, 192, 256, jnp.float16)
  out = _run(kernel, config, a, b, out_dtype=jnp.float32)
  assert out.dtype == jnp.float32
  _check(out, a, b)


def test_all_gather_returns_the_gathered_operand(keys):
  a, b = _operands(keys, 256, 192, 256)
  out, gathered = _run(kernels.all_gather_lhs_matmul,
                       kernels.AllGatherConfig(), a, b, return_gathered=True)
  _check(out, a, b)
  np.testing.assert_array_equal(np.asarray(gathered)[0], np.asarray(a))


@pytest.mark.parametrize("save_gathered", [True, False])
def test_a_pallas_mlp_trains_forward_and_backward(save_gathered, keys,
                                                  monkeypatch):
  """value_and_grad through both ops with impl="pallas" (4 kernel calls:
  each op's kernel forward, the other one transposed in the backward)
  against the same MLP in f32, at D = 1."""
  # The ops refuse impl="pallas" off a Hopper GPU; here it is interpreted.
  monkeypatch.setattr(selection, "device_facts",
                      lambda mesh=None: selection.DeviceFacts(
                          "gpu", "NVIDIA H200", 132, 1, 8))
  x = normal(keys(), (2, 256, 256), jnp.bfloat16)
  wi = (normal(keys(), (256, 512), jnp.float32) / 16).astype(jnp.bfloat16)
  wo = (normal(keys(), (512, 256), jnp.float32) / 22).astype(jnp.bfloat16)
  specs = (P(None, "x", None), P(None, "x"), P("x", None))

  def loss(mlp):
    return lambda *args: jnp.sum(jnp.square(mlp(*args).astype(jnp.float32)))

  def reference_mlp(x, wi, wo):
    h = jax.nn.gelu(jnp.einsum("bsd,df->bsf", x, wi))
    return jnp.einsum("bsf,fd->bsd", h, wo)

  grad = jax.value_and_grad(loss(pallas_mlp(save_gathered)), (0, 1, 2))
  with jax.set_mesh(mesh_1d(1)):
    f = jax.jit(jax.shard_map(grad, in_specs=specs, out_specs=(P(), specs),
                              check_vma=False))
    args = [jax.sharding.reshard(a, s) for a, s in zip((x, wi, wo), specs)]
    hlo = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("custom_call @mosaic_gpu") == 4
    value, grads = _interpreted(lambda: f(*args))
  f32 = [np.asarray(a, np.float32) for a in (x, wi, wo)]
  want_value, want_grads = jax.value_and_grad(loss(reference_mlp),
                                              (0, 1, 2))(*f32)
  assert abs(float(value) / float(want_value) - 1) < TOLERANCE
  for got, want in zip(grads, want_grads):
    got, want = np.asarray(got, np.float32), np.asarray(want)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
