"""Sharding over a 2-D device mesh ('data', 'model'), in T5X's terms.

The mesh has `num_partitions` devices along 'model' (T5X's num_partitions) and the
rest along 'data'. Parameters are placed by the logical axis names the model records
in `params_axes` (T5X's names: 'vocab', 'embed', 'mlp', 'heads', 'joined_kv', ...),
mapped to mesh axes by logical axis rules (T5X's defaults in
`STANDARD_LOGICAL_AXIS_RULES`); batches are split over 'data'. Nothing here runs a
parallel program itself: the decoders are ordinary `jax.jit` functions, and XLA's
SPMD partitioner (GSPMD) propagates the shardings of the placed inputs through the
whole generation. Traced inside `partitioner.activation_sharding()`, the model also
pins its activations by logical names (heads, MLP units and vocabulary over 'model',
rows over 'data', the decoder cache likewise; jaxspec/model/sharding.py), the target
by the target's rules and the draft by the draft's.

  config = PartitioningConfig(num_partitions=8)   # e.g. 1 x 8 on an 8-chip slice
  partitioner = create_partitioner(config)
  target_params = partitioner.load_params(checkpoint, target_config)   # no full copy
  draft_params = partitioner.place_params(draft_params, draft_config, draft=True)
  encoder_tokens = partitioner.shard_batch(encoder_tokens_numpy)       # [b, s]
  with partitioner.activation_sharding():
    result = speculative_generate(target_params, draft_params, encoder_tokens, ...)
  tokens = partitioner.to_host(result.output.tokens)                   # on every host

A dimension that the mesh axis does not divide (e.g. 4 heads over 8 model partitions,
or a batch of 1 over 2 data replicas) stays replicated: device_put cannot place uneven
shards, and such tables are small.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.core
from flax.linen import partitioning as flax_partitioning
import jax
from jax.experimental import multihost_utils
import numpy as np

from jaxspec.checkpoints import sharded
from jaxspec.config import T5Config
from jaxspec.errors import InvalidSetting
from jaxspec.model import abstract_params
from jaxspec.model import sharding as activation_partitioning
from jaxspec.model.sharding import mesh_axes  # noqa: F401  (part of this module's API)

MESH_AXES = ('data', 'model')
LogicalAxisRules = tuple[tuple[str, Any], ...]

# T5X's standard_logical_axis_rules() (1-D parameter and activation partitioning).
STANDARD_LOGICAL_AXIS_RULES: LogicalAxisRules = (
    ('batch', 'data'),
    ('vocab', 'model'),
    ('embed', None),
    ('mlp', 'model'),
    ('heads', 'model'),
    ('kv', None),
    ('joined_kv', 'model'),
    ('relpos_buckets', None),
    ('abspos_buckets', None),
    ('length', None),
    ('layers', None),
    ('stack', None),
    ('mlp_activations', None),
)

# Every parameter replicated, the batch still split over 'data': for a small draft,
# whose matmuls are too small to pay for model-parallel collectives.
REPLICATED_LOGICAL_AXIS_RULES: LogicalAxisRules = (('batch', 'data'),) + tuple(
    (name, None) for name, _ in STANDARD_LOGICAL_AXIS_RULES[1:])


def _as_rules(rules) -> LogicalAxisRules:
  """Lists from gin -> the hashable tuple of (logical name, mesh axis or None) pairs."""
  return tuple((str(name), tuple(axis) if isinstance(axis, list) else axis)
               for name, axis in rules)


@dataclasses.dataclass(frozen=True)
class PartitioningConfig:
  """How decoding is laid out over the devices (gin: `jaxspec.PartitioningConfig`)."""
  # Devices along 'model' (tensor parallelism); the remaining factor is 'data'.
  num_partitions: int = 1
  # Use only the first num_devices devices (None: all devices of all processes).
  num_devices: int | None = None
  logical_axis_rules: LogicalAxisRules = STANDARD_LOGICAL_AXIS_RULES
  # The draft model's rules; the default keeps its parameters replicated.
  draft_logical_axis_rules: LogicalAxisRules = REPLICATED_LOGICAL_AXIS_RULES
  # Multi-host (TPU pods, multi-node GPU): call jax.distributed.initialize first.
  # On Cloud TPU the three fields below can stay None (detected from the environment).
  initialize_distributed: bool = False
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None

  def __post_init__(self):
    if self.num_partitions < 1:
      raise InvalidSetting(f'num_partitions must be >= 1, got {self.num_partitions}')
    if self.num_devices is not None and self.num_devices < 1:
      raise InvalidSetting(f'num_devices must be >= 1 or None, got {self.num_devices}')
    object.__setattr__(self, 'logical_axis_rules', _as_rules(self.logical_axis_rules))
    object.__setattr__(self, 'draft_logical_axis_rules',
                       _as_rules(self.draft_logical_axis_rules))


def make_mesh(num_partitions: int, num_devices: int | None = None,
              devices=None) -> jax.sharding.Mesh:
  """A ('data', 'model') mesh of shape [devices / num_partitions, num_partitions].

  devices: default jax.devices() (all processes), the first num_devices of them.
  jax.make_mesh orders them for the physical topology (rings on TPU).
  """
  devices = list(jax.devices() if devices is None else devices)[:num_devices]
  if len(devices) % num_partitions:
    raise ValueError(f'num_partitions {num_partitions} does not divide the '
                     f'{len(devices)} devices')
  shape = (len(devices) // num_partitions, num_partitions)
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # GSPMD propagation
  return jax.make_mesh(shape, MESH_AXES, axis_types, devices=devices)


def logical_sharding(logical_axes, shape, mesh, rules) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(mesh, mesh_axes(logical_axes, shape, mesh, rules))


def param_shardings(config: T5Config, mesh, rules: LogicalAxisRules) -> dict:
  """The NamedSharding of every parameter of `config`: a tree like variables['params'],
  from the logical axes the model declares (no parameter is allocated)."""
  variables = abstract_params(config)
  axes = flax.core.unfreeze(flax_partitioning.get_axis_names(variables['params_axes']))
  return jax.tree.map(
      lambda names, leaf: logical_sharding(names, leaf.shape, mesh, rules),
      axes, variables['params'],
      is_leaf=lambda node: isinstance(node, jax.sharding.PartitionSpec))


def batch_sharding(mesh, shape) -> jax.sharding.NamedSharding:
  """Leading dimension over 'data' (replicated if 'data' does not divide it)."""
  return logical_sharding(('batch',) + (None,) * (len(shape) - 1), shape, mesh,
                          (('batch', 'data'),))


def replicated(mesh) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def place(array, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array with `sharding` from a host value every process holds in full.

  Each process transfers only the slices of its own devices (multi-host safe).
  """
  host = np.asarray(array)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_tree(tree, shardings):
  """`place` over a tree and a matching tree of shardings."""
  return jax.tree.map(place, tree, shardings)


def to_host(tree):
  """Global arrays -> numpy arrays with the full values, on every process."""
  return multihost_utils.process_allgather(tree, tiled=True)


class FollowerWriter:
  """Stands in for the output file on processes other than 0: they decode the same
  batches as process 0 (every process takes part in every SPMD step) and write nothing.
  `records` maps the indices finished so far to None."""

  def __init__(self, finished):
    self.records = {int(index): None for index in finished}

  def append(self, records):
    for record in records:
      self.records[record['index']] = None


def process_zero_writer(open_writer, path: str):
  """open_writer(path) on process 0; elsewhere a FollowerWriter that knows the indices
  process 0 found finished (broadcast from it), so all processes resume alike."""
  writer = open_writer(path) if jax.process_index() == 0 else None
  if jax.process_count() == 1:
    return writer
  finished = np.asarray(sorted(writer.records) if writer else [], np.int32)
  count = int(multihost_utils.broadcast_one_to_all(np.int32(finished.size)))
  padded = np.zeros((count,), np.int32)
  padded[:finished.size] = finished[:count]
  finished = multihost_utils.broadcast_one_to_all(padded)
  return writer if writer is not None else FollowerWriter(finished.tolist())


def initialize_distributed(config: PartitioningConfig) -> None:
  """jax.distributed.initialize with the configured coordinator (once per process)."""
  if jax.distributed.is_initialized():
    return
  jax.distributed.initialize(coordinator_address=config.coordinator_address,
                             num_processes=config.num_processes,
                             process_id=config.process_id)


@dataclasses.dataclass(frozen=True)
class Partitioner:
  """A mesh and the logical axis rules of the target and of the draft model."""
  mesh: jax.sharding.Mesh
  rules: LogicalAxisRules = STANDARD_LOGICAL_AXIS_RULES
  draft_rules: LogicalAxisRules = REPLICATED_LOGICAL_AXIS_RULES

  def param_shardings(self, config: T5Config, draft: bool = False) -> dict:
    return param_shardings(config, self.mesh, self.draft_rules if draft else self.rules)

  def activation_sharding(self):
    """A block within which decoders are traced with activation constraints: the
    target's activations by `rules`, the draft's by `draft_rules`, on this mesh."""
    return activation_partitioning.activation_sharding(
        self.mesh, {activation_partitioning.TARGET: self.rules,
                    activation_partitioning.DRAFT: self.draft_rules})

  def place_params(self, variables: Mapping[str, Any], config: T5Config,
                   draft: bool = False) -> dict:
    """{'params': tree} (host or device arrays) -> {'params': sharded arrays}."""
    shardings = self.param_shardings(config, draft)
    return {'params': place_tree(dict(variables['params']), shardings)}

  def load_params(self, checkpoint: str, config: T5Config, draft: bool = False,
                  dtype=None) -> dict:
    """{'params': ...} read from a T5X checkpoint straight into the shardings, each
    process reading only its devices' slices. dtype: default config.param_dtype."""
    params = sharded.load_t5x_checkpoint_sharded(
        checkpoint, config, self.param_shardings(config, draft),
        dtype=config.param_dtype if dtype is None else dtype)
    return {'params': params}

  def place_replicated(self, tree):
    """Every array of `tree` whole on every device of the mesh (e.g. n-gram tables)."""
    return place_tree(tree, jax.tree.map(lambda _: replicated(self.mesh), tree))

  def shard_batch(self, array) -> jax.Array:
    """Host batch [b, ...] (the same on every process) -> split over 'data'."""
    return place(array, batch_sharding(self.mesh, np.shape(array)))

  def to_host(self, tree):
    return to_host(tree)

  @property
  def is_output_process(self) -> bool:
    """Only process 0 writes outputs."""
    return jax.process_index() == 0


def create_partitioner(config: PartitioningConfig) -> Partitioner:
  """Initializes multi-host JAX if configured (before any device is touched), then
  builds the mesh."""
  if config.initialize_distributed:
    initialize_distributed(config)
  mesh = make_mesh(config.num_partitions, config.num_devices)
  return Partitioner(mesh, config.logical_axis_rules, config.draft_logical_axis_rules)
