"""Small-problem cut-off sweep (runs 27-29): per shape the bound, NCCL +
cuBLAS, ours (the current selection at impl=pallas) and, for the all-gather,
the variants below, through scripts/bench_kernels.py's functions (checks
against the f32 reference with poisoned outputs included).

  PYTHONPATH=plugin:host python benchmarks/kernel_lead/cutoff_sweep.py \
      --out X.json --ag 256/4096/4096 ... --rs 256/4096/4096 ... \
      [--rs-loopback 512/4096/4096 ...]

The device scripts ran it as .scratch/diag/cutoff.py (this file); run 27 ran
an earlier `variants` (run27_cutoff_variants.diff).
"""
import argparse, dataclasses, json, os, sys, time
sys.path.insert(0, "scripts")
import bench_kernels as bk
import jax, jax.numpy as jnp
from collective_matmul import selection as s

def variants(m, k, n, d=2, sms=132):
  """No dedicated senders, and the current tiles with 4/8/16/32 senders
  (where the SMs the tiles leave idle allow)."""
  dt = jnp.bfloat16
  base = s._heuristic_config(m, k, n, dt, d, sms, None)
  cur = s.select_config(m, k, n, dt, d, sms)
  out = [s._chained(base, k, n, d)]  # no dedicated senders
  if cur.sender_sms and cur.k_major_sends:
    idle = sms - d * s._tiles_per_step(cur, m, n)
    for S in (4, 8, 16, 32):
      if S == 4 or S <= idle:
        out.append(dataclasses.replace(cur, sender_sms=S))
  seen, res = {cur}, []
  for c in out:
    if c is not None and c not in seen:
      seen.add(c); res.append(c)
  return res

def main():
  p = argparse.ArgumentParser()
  p.add_argument("--ag", nargs="*", default=[])
  p.add_argument("--rs", nargs="*", default=[])
  p.add_argument("--rs-loopback", nargs="*", default=[])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--out", required=True)
  a = p.parse_args()
  rows = []
  versions = {"jax": jax.__version__, "devices": [str(x.device_kind) for x in jax.devices()]}
  def save(row):
    rows.append(row)
    print(json.dumps(row), flush=True)
    json.dump({"versions": versions, "argv": sys.argv, "rows": rows}, open(a.out, "w"), indent=1)
  ns = lambda **kw: argparse.Namespace(iterations=10, rounds=a.rounds, skip_seed=True,
                                       windowed=False, config=[], rs_config=[], **kw)
  for text in a.ag:
    m, k, n, dt = bk.parse_shape(text)
    cfgs = [json.dumps(dataclasses.asdict(c)) for c in variants(m, k, n)]
    t0 = time.time()
    row = bk.bench_shape(m, k, n, dt, _with(ns(), config=cfgs))
    row["wall_s"] = time.time() - t0; save(row)
  for text in a.rs + a.rs_loopback:
    m, k, n, dt = bk.parse_shape(text)
    cfgs = []
    if text in a.rs_loopback:
      c = dataclasses.asdict(s.select_reduce_scatter_config(m, k, n, jnp.bfloat16, 2))
      c["loopback"] = True; cfgs.append(json.dumps(c))
    t0 = time.time()
    row = bk.bench_reduce_scatter(m, k, n, dt, _with(ns(), rs_config=cfgs))
    row["wall_s"] = time.time() - t0; save(row)

def _with(ns, **kw):
  for key, v in kw.items(): setattr(ns, key, v)
  return ns

if __name__ == "__main__":
  main()
