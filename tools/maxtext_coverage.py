"""Which matmuls of each MaxText decoder block the plugin serves, on CPU.

Trains a tiny model per MaxText decoder block through the launcher
(`python -m collective_matmul.integrations.maxtext`, plugin on) on 8
emulated CPU devices (data 2 x tensor-sequence 4), reads its closing summary
and writes one markdown table: per block, the projections rewritten, the
ones left to MaxText and why.

    python tools/maxtext_coverage.py                  # every block
    python tools/maxtext_coverage.py --blocks llama2,mixtral --out table.md
    python tools/maxtext_coverage.py --quantization fp8   # MaxText's fp8
    python tools/maxtext_coverage.py --losses   # and the same loss, off

`--losses` trains each model twice more with the plugin off: on the same
mesh, and with `tensor` in place of `tensor_sequence` (MaxText's own
program on another layout: how far its losses move where only the order
of float sums changes, the yardstick for the plugin's difference).

Needs MaxText (Python 3.12, `.[maxtext]`). A run that fails is a row that
says so, with MaxText's last line.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "docs", "MAXTEXT_COVERAGE.md")
# `--quantization`: the MaxText setting, and the table's default file.
QUANTIZATIONS = {"fp8": os.path.join(REPO_ROOT, "docs",
                                     "MAXTEXT_COVERAGE_FP8.md")}

# Every model: 8 emulated devices, the README's mesh, a few steps.
COMMON = (
    "hardware=cpu", "skip_jax_distributed_system=True",
    "dataset_type=synthetic", "override_model_config=True",
    "vocab_size=1024", "max_target_length=128", "per_device_batch_size=1",
    "steps=3", "enable_checkpointing=False", "log_config=False",
    "ici_data_parallelism=2", "ici_tensor_sequence_parallelism=4",
    "dtype=float32", "weight_dtype=float32", "matmul_precision=highest",
    # Tiny models replicate more of their (small) parameters than MaxText's
    # check allows by default; it changes nothing in the program.
    "sharding_tolerance=0.5")


def _small(**changes):
  """A small transformer: width 256, 8 query and 4 key/value heads of 32."""
  keys = dict(base_emb_dim=256, base_mlp_dim=512, base_num_query_heads=8,
              base_num_kv_heads=4, head_dim=32)
  return tuple(f"{k}={v}" for k, v in {**keys, **changes}.items())


SMALL = _small()
# Routed experts, few and small; ragged_dot (megablox interprets its Pallas
# kernel on CPU, slowly).
MOE = ("num_experts=4", "base_moe_mlp_dim=512", "megablox=False")
TOP2 = ("num_experts_per_tok=2",)


# MaxText itself (plugin off) cannot train deepseek4 under tensor-sequence
# parallelism, where the plugin serves anything: found with this sweep's
# settings and the launcher, plugin off.
DEEPSEEK4_SKIP = (
    "MaxText 0.2.5 cannot train it with tensor_sequence > 1, plugin off "
    "too: its compressed attention's key/value projection (wkv) has one "
    "head, which tensor_sequence cannot shard (IndivisibleError at "
    "initialization), and with more heads its attention fails "
    "(concatenating the compressed keys of one head with the others)")


@dataclasses.dataclass(frozen=True)
class Block:
  """One MaxText decoder block and the tiny model that exercises it."""

  name: str  # MaxText's `decoder_block`.
  model: str  # A MaxText model config (`model_name`) with that block.
  overrides: tuple[str, ...]
  # Why the block is not trained here, when it cannot be on this mesh.
  skip: str = ""


def _layers(n):
  return (f"base_num_decoder_layers={n}",)


BLOCKS = (
    Block("default", "default", (*SMALL, *_layers(2))),
    Block("llama2", "llama2-7b", (*SMALL, *_layers(2))),
    Block("mistral", "mistral-7b", (*SMALL, *_layers(2))),
    Block("mixtral", "mixtral-8x7b", (*SMALL, *MOE, *TOP2, *_layers(2))),
    Block("deepseek", "deepseek3-tiny", (
        *_small(base_num_kv_heads=8), *MOE, *TOP2, *_layers(2),
        "first_num_dense_layers=1", "q_lora_rank=64", "kv_lora_rank=32",
        "qk_nope_head_dim=32", "qk_rope_head_dim=16", "v_head_dim=32",
        "shared_experts=1")),
    Block("gemma", "gemma-2b", (*SMALL, *_layers(2))),
    Block("gemma2", "gemma2-2b", (*SMALL, *_layers(2))),
    Block("gemma3", "gemma3-4b", (*SMALL, *_layers(6))),
    Block("gemma4", "gemma4-26b", (*SMALL, *MOE, *TOP2, *_layers(6),
                                   "global_head_dim=64",
                                   "global_num_kv_heads=4")),
    # Two layers share key/value: each reuses its type's last unshared one
    # (5 local, then 1 global: 12 layers give each type one).
    Block("gemma4_small", "gemma4-e2b", (
        *SMALL, *_layers(12), "global_head_dim=64", "global_num_kv_heads=4",
        "scan_layers=False", "hidden_size_per_layer_input=32",
        "vocab_size_per_layer_input=1024", "num_kv_shared_layers=2")),
    Block("qwen2", "qwen2.5-1.5b", (*SMALL, *_layers(2))),
    Block("qwen3", "qwen3-0.6b", (*SMALL, *_layers(2))),
    Block("qwen3_moe", "qwen3-30b-a3b", (*SMALL, *MOE, *TOP2, *_layers(2))),
    Block("qwen3_custom_moe", "qwen3-custom-30b-a3b",
          (*SMALL, *MOE, *TOP2, *_layers(2))),
    Block("qwen3_next", "qwen3-next-80b-a3b", (
        *SMALL, *MOE, *TOP2, *_layers(4), "gdn_key_head_dim=32",
        "gdn_value_head_dim=32", "gdn_num_key_heads=4",
        "gdn_num_value_heads=8")),
    # Its multimodal rotary sections need a rotary dimension of 64.
    Block("qwen3_5", "qwen3.5-35b-a3b", (
        *_small(head_dim=256), *MOE, *TOP2, *_layers(4), "gdn_key_head_dim=32",
        "gdn_value_head_dim=32", "gdn_num_key_heads=4",
        "gdn_num_value_heads=8")),
    Block("gpt3", "gpt3-52k", (*_small(base_num_kv_heads=8), *_layers(2))),
    Block("gpt_oss", "gpt-oss-20b", (*SMALL, *MOE, *TOP2, *_layers(2))),
    Block("simple", "default", (*SMALL, *_layers(2), "decoder_block=simple")),
    Block("simple_mlp", "default", (*SMALL, *_layers(2),
                                    "decoder_block=simple_mlp")),
    Block("llama4", "llama4-17b-16e", (*SMALL, *MOE, "num_experts_per_tok=1",
                                       *_layers(4))),
    Block("olmo3", "olmo3-7b", (*SMALL, *_layers(4))),
    Block("deepseek4", "deepseek4-tiny", (*SMALL, *MOE, *TOP2, *_layers(4),
                                         "attention=dot_product"),
          skip=DEEPSEEK4_SKIP),
    Block("envy", "envy-test", (*SMALL, *MOE, *TOP2, *_layers(2))),
)


# `--losses`' yardstick: the plugin off, with the tensor-sequence axis's
# devices on tensor instead: the same model, with the sums over a sharded
# contraction (forward and backward) in another order.
FLOOR_MESH = {"ici_tensor_sequence_parallelism": "1",
              "ici_tensor_parallelism": "4"}


@dataclasses.dataclass(frozen=True)
class Coverage:
  """What the launcher's closing summary said of one block's model."""

  block: Block
  rewritten: int | None = None  # None: the run failed.
  total: int | None = None
  served: tuple[str, ...] = ()  # "names: how" per kind of rewrite.
  left: tuple[str, ...] = ()  # "names: reason" per reason.
  error: str = ""
  losses: tuple[float, ...] = ()  # Per step, from MaxText's metrics file.

  def row(self) -> str:
    cells = [f"`{self.block.name}`", f"`{self.block.model}`"]
    if self.rewritten is None:
      cells += ["did not run", "", _escape(self.error)]
    else:
      cells += [f"{self.rewritten} of {self.total}",
                "<br>".join(map(_escape, self.served)) or "(none)",
                "<br>".join(map(_escape, self.left)) or "(none)"]
    return "| " + " | ".join(cells) + " |"


def _escape(text: str) -> str:
  return text.replace("|", "\\|")


_HEAD = re.compile(r"^  rewritten: (\d+) of (\d+) projections$")
# fp8's gradient matmuls (`NAME/dgrad`), which the summary counts apart and
# these tables count with the projections (each fp8 projection twice).
_GRADIENTS = re.compile(r"^  and (\d+) of (\d+) gradient matmuls ")
# A note under the served projections, not a kind of rewrite.
_NOTE = "    fp8 siblings not grouped: "
_SERVED = re.compile(r"^    -> (.*?): (.*?)(?: \((.*)\))?$")


def read_summary(block: Block, stdout: str) -> Coverage:
  """The coverage the closing summary in `stdout` reports."""
  lines = stdout.splitlines()
  start = next((i for i, line in enumerate(lines)
                if line.startswith("collective matmul summary")), None)
  if start is None:
    return Coverage(block, error="no closing summary")
  rewritten = total = None
  served, left, section = [], [], None
  for line in lines[start + 1:]:
    if not line.startswith("  "):
      break
    head = _HEAD.match(line)
    gradients = _GRADIENTS.match(line)
    if head:
      rewritten, total, section = int(head[1]), int(head[2]), "served"
    elif gradients and rewritten is not None:
      rewritten += int(gradients[1])
      total += int(gradients[2])
      section = "served"
    elif line.startswith(_NOTE):
      continue
    elif line.startswith("  left to MaxText / XLA"):
      section = "left"
    elif line.startswith("    ") and section == "served":
      how = _SERVED.match(line)
      served.append(f"{how[2]}: {how[1]}")
    elif line.startswith("    ") and section == "left":
      left.append(line.strip())
    else:
      section = None
  return Coverage(block, rewritten, total, tuple(served), tuple(left))


def _train(block: Block, workdir: str, run_name: str, python: str,
           timeout: int, quantization: str | None, plugin: bool,
           mesh: dict[str, str] | None = None
           ) -> tuple[str, tuple[float, ...], str]:
  """Trains `block`'s tiny model through the launcher (plugin on or off,
  on COMMON's mesh changed by `mesh`): its stdout, its loss per step, and
  the error line where it failed ("" where it did not)."""
  import maxtext  # pylint: disable=g-import-not-at-top
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs",
                      "base.yml")
  mesh = mesh or {}
  common = [c for c in COMMON if c.split("=")[0] not in mesh]
  metrics = os.path.join(workdir, f"{run_name}.jsonl")
  argv = [python, "-m", "collective_matmul.integrations.maxtext", base,
          f"run_name={run_name}", f"base_output_directory={workdir}",
          f"model_name={block.model}", *common,
          *(f"{k}={v}" for k, v in mesh.items()), *block.overrides,
          *([f"quantization={quantization}"] if quantization else []),
          f"metrics_file={metrics}",
          *(["--use_collective_matmul"] if plugin else [])]
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.join(REPO_ROOT, "plugin"), env.get("PYTHONPATH", "")])
  try:
    run = subprocess.run(argv, capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=workdir)
  except subprocess.TimeoutExpired:
    return "", (), f"timed out after {timeout} s"
  if run.returncode != 0:
    lines = [l.strip() for l in run.stderr.splitlines() if l.strip()]
    errors = [l for l in lines if re.match(r"^[\w.]*(Error|Exception)\b", l)
              or "error" in l.lower()]
    last = (errors or lines or [f"exit status {run.returncode}"])[-1]
    return run.stdout, (), last[:300]
  if not os.path.exists(metrics):
    return run.stdout, (), f"no metrics file ({metrics})"
  return run.stdout, read_losses(metrics), ""


def read_losses(path: str) -> tuple[float, ...]:
  """The loss of each step in MaxText's metrics file (JSON lines)."""
  with open(path) as f:
    return tuple(json.loads(line)["learning/loss"] for line in f
                 if line.strip())


def run_block(block: Block, workdir: str, python: str = sys.executable,
              timeout: int = 1800, quantization: str | None = None
              ) -> Coverage:
  """Trains `block`'s tiny model through the launcher, plugin on (with
  MaxText's `quantization` where given)."""
  if block.skip:
    return Coverage(block, error=f"not run: {block.skip}")
  stdout, losses, error = _train(block, workdir, f"{block.name}-on", python,
                                 timeout, quantization, plugin=True)
  if error:
    return Coverage(block, error=error)
  return dataclasses.replace(read_summary(block, stdout), losses=losses)


def _max_rel(losses, reference) -> float:
  return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


@dataclasses.dataclass(frozen=True)
class LossCheck:
  """One block's losses: plugin on, off, and off on FLOOR_MESH."""

  block: Block
  on: tuple[float, ...] = ()
  off: tuple[float, ...] = ()
  floor: tuple[float, ...] = ()
  error: str = ""

  def row(self) -> str:
    cells = [f"`{self.block.name}`"]
    if self.error:
      cells += ["did not run", "", "", _escape(self.error)]
    else:
      cells += [" ".join(f"{x:.6f}" for x in self.on),
                " ".join(f"{x:.6f}" for x in self.off),
                f"{_max_rel(self.on, self.off):.1e}",
                f"{_max_rel(self.floor, self.off):.1e}"]
    return "| " + " | ".join(cells) + " |"


def check_losses(coverage: Coverage, workdir: str,
                 python: str = sys.executable, timeout: int = 1800,
                 quantization: str | None = None) -> LossCheck:
  """`coverage`'s losses (plugin on) against the plugin off, on the same
  mesh and on FLOOR_MESH."""
  block = coverage.block
  if coverage.rewritten is None:
    return LossCheck(block, error=coverage.error or "did not run")
  runs = {}
  for name, mesh in (("off", None), ("floor", FLOOR_MESH)):
    _, losses, error = _train(block, workdir, f"{block.name}-{name}", python,
                              timeout, quantization, plugin=False, mesh=mesh)
    if error:
      return LossCheck(block, error=f"plugin off ({name}): {error}")
    runs[name] = losses
  if not len(coverage.losses) == len(runs["off"]) == len(runs["floor"]) > 0:
    return LossCheck(block, error=(
        f"steps logged: {len(coverage.losses)} on, {len(runs['off'])} off, "
        f"{len(runs['floor'])} off on the other mesh"))
  return LossCheck(block, coverage.losses, runs["off"], runs["floor"])


@dataclasses.dataclass(frozen=True)
class _Row:
  """A row kept from an earlier table (`--merge`)."""

  text: str

  def row(self) -> str:
    return self.text


_COVERAGE_HEAD = ("| block | model | rewritten | served | left to MaxText "
                  "/ XLA, and why |", "|---|---|---|---|---|")
_LOSSES_HEAD = ("| block | loss per step, plugin on | plugin off | on vs off "
                "| off, tensor vs tensor_sequence |", "|---|---|---|---|---|")


def committed_rows(path: str = DEFAULT_OUT, losses: bool = False
                   ) -> dict[str, str]:
  """The rows of the coverage table at `path` (with `losses`: of its
  losses table), by block name."""
  wanted, rows, current = _LOSSES_HEAD if losses else _COVERAGE_HEAD, {}, None
  with open(path) as f:
    for line in f:
      line = line.rstrip("\n")
      if line.startswith("| block |"):
        current = line
      elif line.startswith("| `") and current == wanted[0]:
        rows[line.split("|")[1].strip().strip("`")] = line
  return rows


def table(rows, head=_COVERAGE_HEAD) -> str:
  """The markdown table of `rows` (a `row()` each), one per block."""
  return "\n".join([*head, *(r.row() for r in rows)]) + "\n"


def _losses_section(checks) -> str:
  steps = dict(c.split("=", 1) for c in COMMON)["steps"]
  mesh = ", ".join(f"{k}={v}" for k, v in FLOOR_MESH.items())
  return f"""
## The same loss

`--losses`: each model trained again with the plugin off, on the same
mesh (`on vs off`: the largest relative difference of a step's loss over
the {steps} steps), and off on another layout of the same devices
(`{mesh}`):
MaxText's own program with its sums in another order. The
plugin's rings sum in another order too, so the last column is the
yardstick for the one before. In fp8 both are larger than in float32:
where a sum's last bit differs, an fp8 rounding may flip, and the flip
(at most an eighth of the value in e4m3) carries through every later
layer. A block whose routing or grouping depends on the layout (MoE
capacity, per-shard statistics) moves in the last column for that reason
too.

{table(checks, _LOSSES_HEAD)}
{_losses_summary(checks)}
"""


def _losses_summary(checks) -> str:
  """The median and the largest of the losses table's two columns of
  differences (read back from the rows, so that merged rows count)."""
  columns = ([], [])
  for check in checks:
    cells = [c.strip() for c in check.row().split("|")[1:-1]]
    if cells[1] != "did not run":
      columns[0].append(float(cells[3]))
      columns[1].append(float(cells[4]))
  if not columns[0]:
    return "No block trained."
  text = [f"median {statistics.median(c):.1e}, largest {max(c):.1e}"
          for c in columns]
  return (f"Blocks trained: {len(columns[0])}. On vs off: {text[0]}. "
          f"Plugin off, tensor vs tensor_sequence: {text[1]}.")


def document(coverages, quantization: str | None = None,
             checks=None) -> str:
  setup = " ".join(COMMON + ((f"quantization={quantization}",)
                             if quantization else ()))
  title, flag, fp8 = "", "", ""
  if quantization:
    title = f" with `quantization={quantization}`"
    flag = f" --quantization {quantization}"
    fp8 = """
MaxText's `quantization=fp8` runs each `DenseGeneral` through Flax's fp8
dot (per-tensor delayed scaling): served, its forward is an e4m3 x e4m3
product and its input gradient an e5m2 x e4m3 one, each with the scales
Flax computes (`... -> f32` here: these models compute in float32). Flax's
fp8 dot runs the input gradient's product as a matmul of its own, so each
fp8 projection counts twice (`NAME` and `NAME/dgrad`: llama2's 8 matmuls
are 15 here). The logits and the projections MaxText does not quantize run
in the compute dtype; the reasons a projection is left are the bf16
table's (`MAXTEXT_COVERAGE.md`).
"""
  return f"""# MaxText coverage{title}

What the plugin serves in each MaxText decoder block: a tiny model per
block trained through the launcher with the plugin on
(`--use_collective_matmul`), on 8 emulated CPU devices. Generated by
`python tools/maxtext_coverage.py{flag}` (MaxText 0.2.5, Python 3.12); CI
reproduces a few rows (`tests/integrations/maxtext/test_coverage.py`).
{fp8}
"rewritten N of M" is the launcher's closing summary: M counts every kind
of weight matmul the model runs (each projection once, however many layers
run it), N those rewritten as a collective matmul (on CPU the ring; on
Hopper GPUs the Pallas kernels where they apply). Every matmul left names
its reason.

Common settings: `{setup}`; per block the model's own config, shrunk
(`tools/maxtext_coverage.py`, `BLOCKS`).

Not weight matmuls, so not counted: qwen3-next's and qwen3.5's depthwise
1-D convolution (`conv1d`, one filter per channel) and their delta rule
(activations only), attention's scores and context, the embedding
lookups.

deepseek4 is outside the sweep: {DEEPSEEK4_SKIP}. Its weight matmuls
(the compressed attention's projections, and the manifold-constrained
hyper-connections' mixing einsums, `jnp.einsum` outside `DenseGeneral`)
are neither counted nor served.

{table(coverages)}{_losses_section(checks) if checks else ""}"""


def _merged(ran, kept: dict[str, str]) -> list[_Row]:
  """The rows of `ran`, and `kept`'s of the blocks not in it, in BLOCKS'
  order."""
  rows = {**kept, **{r.block.name: r.row() for r in ran}}
  return [_Row(rows[b.name]) for b in BLOCKS if b.name in rows]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--blocks", default="",
                      help="comma-separated decoder blocks (default: all "
                      f"{len(BLOCKS)}: {', '.join(b.name for b in BLOCKS)})")
  parser.add_argument("--quantization", choices=sorted(QUANTIZATIONS),
                      default=None,
                      help="train with MaxText's quantization=... (default: "
                      "none); the table then goes to its own file")
  parser.add_argument("--out", default=None,
                      help=f"where to write the markdown (default: "
                      f"{DEFAULT_OUT}, or with --quantization fp8 "
                      f"{QUANTIZATIONS['fp8']})")
  parser.add_argument("--jobs", type=int, default=1,
                      help="blocks trained at once (default: %(default)s)")
  parser.add_argument("--merge", action="store_true",
                      help="keep --out's rows of the blocks not run")
  parser.add_argument("--losses", action="store_true",
                      help="train each model with the plugin off too (on "
                      "the same mesh, and with tensor in place of "
                      "tensor_sequence) and add a table of the losses")
  args = parser.parse_args(argv)
  args.out = args.out or QUANTIZATIONS.get(args.quantization, DEFAULT_OUT)
  wanted = [b for b in args.blocks.split(",") if b]
  known = {b.name: b for b in BLOCKS}
  unknown = [b for b in wanted if b not in known]
  if unknown:
    parser.error(f"unknown blocks {unknown}; known: {', '.join(known)}")
  blocks = [known[b] for b in wanted] if wanted else list(BLOCKS)
  workdir = tempfile.mkdtemp(prefix="cm_coverage_")

  def one(block):
    coverage = run_block(block, workdir, quantization=args.quantization)
    check = None
    if args.losses and not block.skip:
      check = check_losses(coverage, workdir,
                           quantization=args.quantization)
    return coverage, check

  coverages, checks = [], []
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    for i, (coverage, check) in enumerate(pool.map(one, blocks)):
      print(f"[{i + 1}/{len(blocks)}] {coverage.row()}", flush=True)
      coverages.append(coverage)
      if check:
        print(f"  {check.row()}", flush=True)
        checks.append(check)
  if args.merge and os.path.exists(args.out):
    coverages = _merged(coverages, committed_rows(args.out))
    checks = _merged(checks, committed_rows(args.out, losses=True))
  with open(args.out, "w") as f:
    f.write(document(coverages, args.quantization, checks))
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
