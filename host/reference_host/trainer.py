"""The train loop: sharded init, one compiled train step, synthetic data,
progress lines, checkpoints.

The collective-matmul configuration is a property of the traced program: the
step is lowered and compiled inside `cm.config_context(collective_config)`, and
the plugin's decisions made during that trace are kept with the compiled step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import statistics
import threading
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import collective_matmul as cm

from reference_host import checkpoint as checkpoint_lib
from reference_host import config as config_lib
from reference_host import mesh as mesh_lib
from reference_host import model as model_lib

# Dense bf16 peak per device, for the MFU estimate (datasheet numbers).
PEAK_FLOPS_BY_DEVICE_KIND = {
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}

TrainState = dict  # {"params": ..., "opt_state": ..., "step": int32 scalar}


class NonFiniteError(FloatingPointError):
  """The loss (or the state about to be saved) is nan or inf: training
  stopped before anything of that step was saved."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class TrainingInterrupted(KeyboardInterrupt):
  """Ctrl-C (SIGINT) or SIGTERM: training stopped after the step (and the
  save) in flight. `signum` is the signal."""

  def __init__(self, message: str, step: int,
               signum: int = signal.SIGINT):
    super().__init__(message)
    self.step = step
    self.signum = signum


# The signals that stop training after the step and save in flight: Ctrl-C,
# and SIGTERM, which schedulers send to preempt a job.
STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@contextlib.contextmanager
def _stop_requests():
  """Yields a list that the first Ctrl-C (SIGINT) or SIGTERM appends its
  signal number to, so the loop can stop after the step and save in flight;
  a second one interrupts at once. Only where Python's default handlers are
  installed (and on the main thread): a handler someone else installed is
  left alone."""
  requests = []
  if threading.current_thread() is not threading.main_thread():
    yield requests
    return
  defaults = {signal.SIGINT: signal.default_int_handler,
              signal.SIGTERM: signal.SIG_DFL}
  ours = [signum for signum, default in defaults.items()
          if signal.getsignal(signum) is default]

  def request_stop(signum, frame):
    if requests:
      raise KeyboardInterrupt
    requests.append(signum)

  for signum in ours:
    signal.signal(signum, request_stop)
  try:
    yield requests
  finally:
    for signum in ours:
      signal.signal(signum, defaults[signum])


def _non_finite_arrays(tree: Any) -> list[str]:
  """Paths of the floating-point arrays in `tree` holding nan or inf."""
  names = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if (jnp.issubdtype(leaf.dtype, jnp.inexact)
        and not bool(jax.device_get(jnp.isfinite(leaf).all()))):
      names.append(jax.tree_util.keystr(path, simple=True, separator="/"))
  return names


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
  leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def synthetic_batch(config: config_lib.Config, step: int) -> np.ndarray:
  """Global token batch [global_batch, max_target_length + 1] for `step`.

  Each row is an arithmetic progression modulo the vocabulary with a random
  start and stride, so the loss can fall (the model learns to infer the
  stride from the context). A pure function of (data_shuffle_seed, step):
  every process builds the same batch, and a resumed run sees the same data
  as an uninterrupted one.
  """
  rng = np.random.default_rng([config.data_shuffle_seed, step])
  batch, length = config.global_batch_size, config.max_target_length + 1
  start = rng.integers(0, config.vocab_size, size=(batch, 1))
  stride = rng.integers(1, min(config.vocab_size, 17), size=(batch, 1))
  return ((start + stride * np.arange(length)) % config.vocab_size).astype(
      np.int32)


def peak_flops_per_device(device: jax.Device) -> float | None:
  kind = getattr(device, "device_kind", "")
  for prefix, peak in PEAK_FLOPS_BY_DEVICE_KIND.items():
    if kind.startswith(prefix):
      return peak
  return None


@dataclasses.dataclass
class StepRecord:
  step: int
  loss: float
  step_time_s: float
  tokens_per_s: float
  tflops_per_device: float
  mfu: float | None
  num_devices: int = 1

  @property
  def tokens_per_s_per_device(self) -> float:
    return self.tokens_per_s / self.num_devices


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  records: list[StepRecord]
  decisions: list  # cm.Decision, from the trace of the train step
  compile_time_s: float
  first_step: int  # the step training started from (> 0 after a resume)

  @property
  def losses(self) -> list[float]:
    return [r.loss for r in self.records]

  @property
  def step_times(self) -> list[float]:
    return [r.step_time_s for r in self.records]


def make_optimizer(config: config_lib.Config) -> optax.GradientTransformation:
  if config.warmup_steps > 0:
    learning_rate = optax.linear_schedule(0.0, config.learning_rate,
                                          config.warmup_steps)
  else:
    learning_rate = config.learning_rate
  chain = []
  if config.gradient_clipping_threshold > 0:
    chain.append(optax.clip_by_global_norm(config.gradient_clipping_threshold))
  chain.append(optax.adamw(learning_rate, b1=config.adam_b1, b2=config.adam_b2,
                           eps=config.adam_eps,
                           weight_decay=config.adam_weight_decay))
  return optax.chain(*chain)


def cross_entropy_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.mean(losses)


def available_memory(devices) -> tuple[int, str]:
  """(bytes, description) of the memory `devices` have together: their
  allocators' limits where they report one (GPUs), else the host memory
  of the processes they span (CPU devices share it)."""
  local = [d for d in devices if d.process_index == jax.process_index()]
  limits = []
  for device in local:
    try:
      stats = device.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except
      stats = {}
    if "bytes_limit" not in stats:
      break
    limits.append(stats["bytes_limit"])
  else:
    if limits:
      total = len(devices) * sum(limits) // len(limits)
      return total, (f"the {total / 2**30:,.1f} GiB of the {len(devices)} "
                     f"{local[0].device_kind} devices")
  processes = len({d.process_index for d in devices})
  try:
    per_host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return 2**63, "this machine"  # Unknown: nothing is refused.
  return processes * per_host, (
      f"the {processes * per_host / 2**30:,.1f} GiB of host memory the "
      f"{len(devices)} {devices[0].platform} devices share")


def check_fits_memory(config: config_lib.Config, devices) -> None:
  """ConfigError (one line) unless the model of `config` (resolved) may fit
  in the memory of `devices`: checked before anything is allocated."""
  config_lib.check_fits_memory(config, model_lib.count_params(config),
                               *available_memory(devices))


# XLA's own overlap of all-gather and matmul (windowed einsum, with its
# collective matmuls on several streams), as the kernel benchmarks run it.
WINDOWED_EINSUM = {"xla_gpu_threshold_for_windowed_einsum_mib": 0,
                   "xla_gpu_multi_streamed_windowed_einsum": True}


class Trainer:
  """Owns the mesh, the model, the state's shardings and the compiled step.

  Args:
    config: a loaded config (resolved for the mesh's devices here).
    collective_config: the plugin configuration the step is traced with;
      default: the plugin's active one (`cm.get_config()`, set from flags).
    devices: the mesh's devices; default: all of them.
    compiler_options: XLA options for compiling the step (e.g. XLA's
      windowed einsum, `WINDOWED_EINSUM`), as `Lowered.compile` takes them.
  """

  def __init__(self, config: config_lib.Config,
               collective_config: cm.CollectiveMatmulConfig | None = None,
               devices=None, compiler_options: dict | None = None):
    devices = list(jax.devices() if devices is None else devices)
    self.config = config_lib.resolve_for_devices(config, len(devices))
    self.collective_config = collective_config or cm.get_config()
    self.mesh = mesh_lib.create_mesh(self.config, devices)
    self.rules = mesh_lib.logical_axis_rules(self.config, self.mesh)
    self.model = model_lib.Transformer(self.config)
    self.optimizer = make_optimizer(self.config)
    self.batch_sharding = mesh_lib.batch_sharding(self.mesh, self.rules)
    self.compiler_options = dict(compiler_options or {})
    self._compiled_step = None
    self.decisions: list = []
    self.compile_time_s = 0.0
    self.state_shardings, self.abstract_state = self._state_layout()

  @contextlib.contextmanager
  def _contexts(self):
    """The mesh, the logical rules and the plugin config, for tracing."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules), \
        cm.config_context(self.collective_config):
      yield

  def _boxed_state(self, rng: jax.Array) -> dict[str, Any]:
    tokens = jnp.zeros((self.config.global_batch_size,
                        self.config.max_target_length), jnp.int32)
    params = self.model.init(rng, tokens)["params"]
    # tx.init maps over the boxed params, so the optimizer moments carry the
    # same logical partitioning as the parameters they track.
    return {"params": params, "opt_state": self.optimizer.init(params),
            "step": jnp.zeros((), jnp.int32)}

  def _state_layout(self):
    with self._contexts():
      boxed = jax.eval_shape(self._boxed_state, jax.random.key(0))
    logical_specs = nn.get_partition_spec(boxed)
    shardings = nn.logical_to_mesh_sharding(logical_specs, self.mesh,
                                            self.rules)
    unboxed = nn.meta.unbox(boxed)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        unboxed, shardings)
    return shardings, abstract

  def logical_param_specs(self):
    """Each parameter's logical axis names (checkpoint compatibility)."""
    with self._contexts():
      boxed = jax.eval_shape(self._boxed_state, jax.random.key(0))
    return nn.get_partition_spec(boxed["params"])

  def init_state(self) -> TrainState:
    """Parameters from `init_weights_seed`, created sharded."""
    check_fits_memory(self.config, list(self.mesh.devices.flat))
    init = jax.jit(lambda rng: nn.meta.unbox(self._boxed_state(rng)),
                   out_shardings=self.state_shardings)
    with self._contexts():
      return init(jax.random.key(self.config.init_weights_seed))

  def _train_step(self, state: TrainState, batch: jax.Array):
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def loss_fn(params):
      logits = self.model.apply({"params": params}, inputs)
      return cross_entropy_loss(logits, targets)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = self.optimizer.update(grads, state["opt_state"],
                                               state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = {"params": params, "opt_state": opt_state,
                 "step": state["step"] + 1}
    return new_state, loss

  def compile(self):
    """Lowers and compiles the step under the plugin config; records the
    plugin's decisions from that trace."""
    if self._compiled_step is not None:
      return self._compiled_step
    batch_shape = jax.ShapeDtypeStruct(
        (self.config.global_batch_size, self.config.max_target_length + 1),
        jnp.int32, sharding=self.batch_sharding)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    step_fn = jax.jit(self._train_step,
                      in_shardings=(self.state_shardings, self.batch_sharding),
                      out_shardings=(self.state_shardings, replicated),
                      donate_argnums=(0,))
    start = time.perf_counter()
    with self._contexts():
      cm.clear_decisions()
      lowered = step_fn.lower(self.abstract_state, batch_shape)
      self.decisions = cm.decisions()
      self._compiled_step = lowered.compile(
          compiler_options=self.compiler_options or None)
    self.compile_time_s = time.perf_counter() - start
    return self._compiled_step

  def global_batch(self, step: int) -> jax.Array:
    host_batch = synthetic_batch(self.config, step)
    return jax.make_array_from_callback(
        host_batch.shape, self.batch_sharding, lambda index: host_batch[index])

  def run_step(self, state: TrainState, step: int
               ) -> tuple[TrainState, StepRecord]:
    """One compiled step on the batch for `step`, timed to completion."""
    compiled = self.compile()
    batch = self.global_batch(step)
    start = time.perf_counter()
    state, loss = compiled(state, batch)
    loss = float(jax.device_get(loss))  # waits for the step to finish
    elapsed = time.perf_counter() - start
    tokens = self.config.global_batch_size * self.config.max_target_length
    tflops = (model_lib.training_flops_per_token(self.config) * tokens
              / elapsed / self.mesh.size / 1e12)
    peak = peak_flops_per_device(self.mesh.devices.flat[0])
    return state, StepRecord(
        step=step, loss=loss, step_time_s=elapsed,
        tokens_per_s=tokens / elapsed, tflops_per_device=tflops,
        mfu=(tflops * 1e12 / peak) if peak else None,
        num_devices=self.mesh.size)

  def train(self, state: TrainState, num_steps: int | None = None, *,
            checkpointer: checkpoint_lib.Checkpointer | None = None,
            log: Callable[[str], None] | None = print,
            on_record: Callable[[StepRecord], None] | None = None
            ) -> TrainResult:
    """Runs from `state["step"]` until `num_steps` (default: config.steps)
    steps are done in total, saving through `checkpointer` when given.
    `log` gets a progress line every `log_period` steps; `on_record` every
    step's record (metrics files).

    Raises NonFiniteError when a step's loss (or the state about to be
    saved) is nan or inf, before anything of that step is saved; and
    TrainingInterrupted on Ctrl-C or SIGTERM, after the step and save in
    flight finish.
    """
    self.compile()
    last_step = self.config.steps if num_steps is None else num_steps
    first_step = int(jax.device_get(state["step"]))
    records = []
    try:
      with _stop_requests() as stop_requests:
        for step in range(first_step, last_step):
          state, record = self.run_step(state, step)
          records.append(record)
          if on_record is not None:
            on_record(record)
          finite = math.isfinite(record.loss)
          if log and (step % self.config.log_period == 0
                      or step == last_step - 1 or not finite):
            log(format_progress(record))
          if not finite:
            raise NonFiniteError(
                f"loss is {record.loss} at step {step}: stopped before "
                f"saving anything from it ({_newest_checkpoint(checkpointer)})",
                step)
          last = step == last_step - 1
          if checkpointer is not None:
            # Seals an asynchronous save as soon as orbax has finished it.
            checkpointer.poll()
            if checkpointer.should_save(step + 1, last=last):
              self._check_finite_state(state, step, checkpointer)
              checkpointer.save(step + 1, state, last=last)
          if stop_requests and not last:
            if checkpointer is not None:
              checkpointer.wait_until_finished()
            raise TrainingInterrupted(
                f"interrupted ({STOP_SIGNALS[stop_requests[0]]}) after step "
                f"{step}: {_newest_checkpoint(checkpointer)}", step,
                stop_requests[0])
    finally:
      if checkpointer is not None:
        checkpointer.wait_until_finished()
    return TrainResult(state=state, records=records, decisions=self.decisions,
                       compile_time_s=self.compile_time_s,
                       first_step=first_step)

  def _check_finite_state(self, state: TrainState, step: int,
                          checkpointer: checkpoint_lib.Checkpointer) -> None:
    """A finite loss can still leave nan/inf in the updated state."""
    if bool(jax.device_get(_all_finite(state))):
      return
    names = _non_finite_arrays(state)
    raise NonFiniteError(
        f"the state after step {step} holds nan or inf in {names[0]}"
        f"{f' and {len(names) - 1} more arrays' if len(names) > 1 else ''}: "
        f"stopped before saving it ({_newest_checkpoint(checkpointer)})",
        step)

  def restore_or_init(self, checkpointer: checkpoint_lib.Checkpointer
                      ) -> tuple[TrainState, int | None]:
    """(state, step) of the latest checkpoint, else (fresh init, None)."""
    step, state = checkpointer.restore_latest(self.abstract_state)
    if state is None:
      return self.init_state(), None
    return state, step


def _newest_checkpoint(checkpointer: checkpoint_lib.Checkpointer | None
                       ) -> str:
  if checkpointer is None:
    return "checkpointing is off"
  steps = checkpointer.all_steps()
  if not steps:
    return f"no checkpoint in {checkpointer.directory} yet"
  return f"newest checkpoint: step {steps[-1]} in {checkpointer.directory}"


def format_progress(record: StepRecord) -> str:
  """MaxText's step line (log tools parse it), plus MFU where known."""
  line = (f"completed step: {record.step}, seconds: {record.step_time_s:.3f}, "
          f"TFLOP/s/device: {record.tflops_per_device:.3f}, "
          f"Tokens/s/device: {record.tokens_per_s_per_device:.3f}, "
          f"loss: {record.loss:.5f}")
  return line + (f", MFU: {100 * record.mfu:.1f}%"
                 if record.mfu is not None else "")


def summarize_step_times(times: list[float]) -> dict[str, float]:
  """Median and spread, leaving out the first step (it warms caches)."""
  steady = times[1:] if len(times) > 2 else times
  return {
      "median_s": statistics.median(steady),
      "min_s": min(steady),
      "max_s": max(steady),
      "stdev_s": statistics.stdev(steady) if len(steady) > 1 else 0.0,
      "count": len(steady),
  }
