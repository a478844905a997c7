"""Activation sharding constraints by logical axis names (T5X's activation partitioning).

The model pins the layout of the activations that matter (attention heads, MLP hidden
units, logits over the vocabulary, the decoder cache) by naming their dimensions:

  x = constrain(x, ('batch', 'length', 'heads', 'kv'), role)

Outside an `activation_sharding` block this returns x unchanged (one device, training,
tests). Inside one, x gets the sharding that the role's logical axis rules give on the
block's mesh, through `jax.lax.with_sharding_constraint`, so XLA's SPMD partitioner keeps
heads and MLP units split over 'model' and rows over 'data' instead of guessing from
the parameters alone. A role is 'target' or 'draft': the two models of one speculative
generation run in the same jit, each under its own rules (a small draft is usually
replicated).

  with activation_sharding(mesh, {'target': rules, 'draft': draft_rules}):
    result = speculative_generate(...)   # traced and compiled inside the block

The block sets the mesh with `jax.set_mesh`, which is part of JAX's compilation cache
key: a decoder traced on another mesh, or on none, is compiled anew. The rules are read
at trace time and are not in that key, so a process keeps one set of rules per mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Mapping

import flax.linen as nn
import jax
import numpy as np

LogicalAxisRules = tuple[tuple[str, Any], ...]
TARGET = 'target'
DRAFT = 'draft'
# Logical names of the activations the model constrains (T5X's names).
EMBED_AXES = ('batch', 'length', 'embed')  # [b, t, e] residual stream
HEADS_AXES = ('batch', 'length', 'heads', 'kv')  # [b, t, h, d] q/k/v
CACHE_AXES = ('batch', 'heads', 'kv', 'length')  # [b, h, d, L] cached keys/values
JOINED_KV_AXES = ('batch', 'length', 'joined_kv')  # [b, t, h*d]
MLP_AXES = ('batch', 'length', 'mlp')  # [b, t, f]
VOCAB_AXES = ('batch', 'length', 'vocab')  # [b, t, v] logits

_RULES_BY_ROLE: contextvars.ContextVar[Mapping[str, LogicalAxisRules]] = (
    contextvars.ContextVar('jaxspec_activation_rules', default={}))


def mesh_axes(logical_axes, shape, mesh, rules: LogicalAxisRules) -> jax.sharding.PartitionSpec:
  """Logical names of each dimension -> the PartitionSpec on `mesh` (a Mesh or an
  AbstractMesh), by flax's priority rule: a mesh axis goes to the first matching rule;
  unmatched names are replicated.

  Dimensions the mesh axes do not divide are replicated (e.g. 4 heads over 8 model
  partitions, or a batch of 1 over 2 data replicas): uneven shards would be padded.
  """
  spec = nn.logical_to_mesh_axes(tuple(logical_axes), rules)
  mesh_shape = dict(mesh.shape)
  divisible = []
  for size, axes in zip(shape, spec):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    devices = int(np.prod([mesh_shape[name] for name in names]))
    divisible.append(axes if names and size % devices == 0 else None)
  return jax.sharding.PartitionSpec(*divisible)


@contextlib.contextmanager
def activation_sharding(mesh: jax.sharding.Mesh, rules_by_role: Mapping[str, LogicalAxisRules]):
  """Within the block, `constrain` applies `rules_by_role[role]` on `mesh`."""
  token = _RULES_BY_ROLE.set(dict(rules_by_role))
  try:
    with jax.set_mesh(mesh):
      yield
  finally:
    _RULES_BY_ROLE.reset(token)


def constrain(x, logical_axes: tuple[str | None, ...], role: str = TARGET):
  """x with the sharding its logical axes get under the current block's rules for
  `role`; x itself outside a block (or for a role without rules)."""
  rules = _RULES_BY_ROLE.get().get(role)
  mesh = jax.sharding.get_abstract_mesh()
  if rules is None or mesh.empty:
    return x
  if len(logical_axes) != x.ndim:
    raise ValueError(f'{len(logical_axes)} logical axes {logical_axes} for an array of '
                     f'shape {x.shape}')
  return jax.lax.with_sharding_constraint(x, mesh_axes(logical_axes, x.shape, mesh, rules))
