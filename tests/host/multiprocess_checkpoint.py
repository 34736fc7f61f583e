"""One process of a 2-process CPU job (jax.distributed, gloo) that opens a
run's checkpoint directory with `reference_host.checkpoint.Checkpointer`,
as a multi-process trainer does, and writes what happened to a JSON file.

  python multiprocess_checkpoint.py PROCESS_ID PORT DIRECTORY SCENARIO OUT.json

SCENARIO:
  save     open, save step 2 of a state sharded over both processes
           (synchronously, sealed by process 0), close;
  restore  open, restore the newest step into the same sharding, close;
  open     open only (the test holds the directory's lock elsewhere).
"""
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from reference_host import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
from reference_host import config as config_lib  # pylint: disable=g-import-not-at-top

process_id, port, directory, scenario, out_path = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2,
                           process_id=process_id)
assert jax.process_count() == 2 and jax.device_count() == 4

repo = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
config = config_lib.load_config([
    os.path.join(repo, "model_configs", "base.yml"), "model_name=tiny",
    "base_num_decoder_layers=1", "max_target_length=32",
    "checkpoint_period=2", "steps=2", f"checkpoint_dir={directory}"])
mesh = jax.make_mesh((4,), ("x",))
sharding = NamedSharding(mesh, P("x", None))
values = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
messages = []
result = {"process": process_id}
try:
  checkpointer = checkpoint_lib.Checkpointer(config, log=messages.append)
  if scenario == "save":
    state = {"w": jax.make_array_from_callback(
        values.shape, sharding, lambda index: values[index])}
    result["saved"] = checkpointer.save(2, state, last=True)
    checkpointer.wait_until_finished()
  elif scenario == "restore":
    step, state = checkpointer.restore_latest(
        {"w": jax.ShapeDtypeStruct(values.shape, values.dtype,
                                   sharding=sharding)})
    result["step"] = step
    result["equal"] = all(
        np.array_equal(np.asarray(shard.data), values[shard.index])
        for shard in state["w"].addressable_shards)
  checkpointer.close()
  result["ok"] = True
except checkpoint_lib.CheckpointError as e:
  result["error"] = type(e).__name__
  result["message"] = str(e)
result["messages"] = messages
with open(out_path, "w") as f:
  json.dump(result, f)
