"""The closed vocabularies (Impl, Collective, MatmulDimension): strings in,
members out, validated in one place, and still strings wherever they were
strings."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

import collective_matmul as cm
from collective_matmul import selection
from collective_matmul.enums import Collective
from collective_matmul.enums import Impl
from collective_matmul.enums import MatmulDimension


@pytest.mark.parametrize("value", ["ring", Impl.RING])
def test_parse_accepts_the_string_and_the_member(value):
  assert Impl.parse(value, "impl") is Impl.RING


@pytest.mark.parametrize("value", ["cuda", "Ring", None, 3])
def test_parse_names_the_field_and_the_choices(value):
  with pytest.raises(ValueError, match=rf"impl={value!r} is not one of "
                     r"\('auto', 'pallas', 'ring', 'baseline'\)"):
    Impl.parse(value, "impl")


def test_parse_restricted_to_allowed_members():
  assert Impl.parse("baseline", "fallback_impl",
                    ("ring", "baseline")) is Impl.BASELINE
  with pytest.raises(ValueError, match=r"fallback_impl='pallas' is not one "
                     r"of \('ring', 'baseline'\)"):
    Impl.parse("pallas", "fallback_impl", ("ring", "baseline"))


def test_members_are_their_strings():
  assert Impl.PALLAS == "pallas" and str(Impl.PALLAS) == "pallas"
  assert f"{Collective.REDUCE_SCATTER}" == "reduce_scatter"
  assert repr(Impl.AUTO) == "'auto'"
  assert json.dumps({Impl.RING: [Collective.ALL_GATHER]}) == (
      '{"ring": ["all_gather"]}')
  assert {"ring": 1}[Impl.RING] == 1


def test_the_backward_runs_the_other_collective():
  assert Collective.ALL_GATHER.transpose is Collective.REDUCE_SCATTER
  assert Collective.REDUCE_SCATTER.transpose is Collective.ALL_GATHER


def test_config_normalises_strings_to_members():
  config = cm.CollectiveMatmulConfig(impl="pallas", fallback_impl="baseline")
  assert config.impl is Impl.PALLAS and config.fallback_impl is Impl.BASELINE
  assert config == cm.CollectiveMatmulConfig(impl=Impl.PALLAS,
                                             fallback_impl=Impl.BASELINE)
  with pytest.raises(ValueError, match="fallback_impl='auto'"):
    cm.CollectiveMatmulConfig(fallback_impl="auto")


def test_selection_takes_strings_at_its_boundary(monkeypatch):
  monkeypatch.setenv("COLLECTIVE_MATMUL_TUNING_CACHE",
                     "/nonexistent/tuning.json")
  hopper = selection.DeviceFacts("gpu", "NVIDIA H200", 132)
  # bf16 operands, a float32 result: the backward's (all-gather) cotangent
  # is float32, which the kernels do not take.
  problem = selection.Problem(4096, 4096, 4096, np.dtype(jnp.bfloat16), 2,
                              np.dtype(np.float32))
  plan = selection.choose("pallas", "reduce_scatter", problem, hopper)
  assert plan.impl is Impl.PALLAS and plan.backward_impl is Impl.RING
  with pytest.raises(ValueError, match="collective='all_reduce'"):
    selection.choose("ring", "all_reduce", problem, hopper)
  with pytest.raises(ValueError, match="collective='matmul'"):
    selection.cache_key(selection.Problem(1, 2, 3, "bfloat16", 2), "H100",
                        collective="matmul")


@pytest.mark.parametrize("name", ["wg_dimension"])
def test_kernel_configs_hold_matmul_dimensions(name, rng):
  value = str(rng.choice(["m", "n"]))
  config = selection.AllGatherConfig(**{name: value})
  assert getattr(config, name) is MatmulDimension(value)
  with pytest.raises(ValueError, match=rf"{name}='k' is not one of "
                     r"\('m', 'n'\)"):
    selection.AllGatherConfig(**{name: "k"})


def test_a_stored_config_reads_back_with_members_and_writes_strings(rng):
  """Tuned tables and caches store the dimensions as "m" / "n"."""
  fields = {"wg_dimension": str(rng.choice(["m", "n"]))}
  config = selection.AllGatherConfig(**fields)
  text = json.dumps(config.to_json(), sort_keys=True)
  assert all(f'"{k}": "{v}"' in text for k, v in fields.items())
  assert selection.AllGatherConfig(**json.loads(text)) == config
  assert hash(selection.AllGatherConfig(**json.loads(text))) == hash(config)
