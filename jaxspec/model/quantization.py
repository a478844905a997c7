"""int8 copies of a model's weights, for drafts made of the target itself.

A decode step on CPU reads every weight of the decoder once and is bound by memory
bandwidth, so the same decoder with int8 weights (a quarter of the float32 bytes) steps
several times faster while proposing almost exactly the target's tokens: the int8 draft
(jaxspec.decoding.drafters.int8) of a target is its own decoder with each per-step
weight matrix quantized. Verification stays with the float32 target, so decoding is
exact whatever the draft computes; quantization only sets how often drafts are accepted.

Symmetric per-output quantization: row o of a kernel [out, in] (the decode layout,
jaxspec.model.cpu.layout) is stored as int8 values q[o] in [-127, 127] and one
float32 scale s[o] = max |w[o]| / 127, w[o] ~ q[o] * s[o]; rows of the token embedding
table [vocab, embed] likewise (one scale per token serves both the embedding lookup and
the tied logits). Params name their form: `kernel_int8` + `kernel_scale`,
`embedding_int8` + `embedding_scale` (jaxspec.model.layers reads either form).

  quantize_rows(w)           w [out, in] -> (int8 [out, in], scale [out])
  dequantize_rows(q, scale)  the float32 matrix they stand for
  tile_int8(q)               q [out, in] -> [out / 64, in / 4, 64, 4], the kernel's tiles
  int8_decoder(params)       a target's decoder params for an int8 draft
  int8_tree(tree)            every projection kernel and token embedding of a tree in int8

Where the CPU kernel's AVX-512 VNNI build computes the products
(jaxspec.model.cpu.matmul.int8_tiles_apply), int8_decoder stores each matrix tiled: the
kernel then sums 16 outputs in the lanes of one vector with no sum across lanes
(few_row_matmul.cc, "Tiled int8 weights"). The embedding table is tiled too, one copy
that the tied logits multiply and the lookup gathers its rows from.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.model.cpu.layout import transposed_kernels
from jaxspec.model.layers import (EMBEDDING_INT8, EMBEDDING_SCALE, KERNEL_INT8, KERNEL_SCALE,
                                  KERNEL_T_PARAM)

INT8_MAX = 127
# Kernels used only once per input (cross-attention keys and values of the encoding):
# they stay float32, so the draft's cross-attention cache equals the target's.
ENCODING_PROJECTIONS = (('encoder_decoder_attention', 'key'),
                        ('encoder_decoder_attention', 'value'))


def quantize_rows(w) -> tuple[np.ndarray, np.ndarray]:
  """w [out, in] float -> (q [out, in] int8, scale [out] float32), w[o] ~ q[o] * scale[o].

  A zero row gets scale 1 (and q 0), so every scale is finite and positive.
  """
  w = np.asarray(w, np.float32)
  if w.ndim != 2:
    raise ValueError(f'int8 quantization takes a 2-D [out, in] matrix, got shape {w.shape}')
  if not np.all(np.isfinite(w)):
    raise ValueError('cannot quantize a matrix holding NaN or infinity')
  peak = np.max(np.abs(w), axis=1)
  scale = np.where(peak > 0, peak / INT8_MAX, 1.0).astype(np.float32)
  q = np.clip(np.rint(w / scale[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
  return q, scale


def dequantize_rows(q, scale) -> np.ndarray:
  """The float32 matrix [out, in] that int8 rows q [out, in] with scale [out] stand for."""
  return np.asarray(q, np.float32) * np.asarray(scale, np.float32)[:, None]


def tileable(q) -> bool:
  """Whether int8 rows q [out, in] tile: out a multiple of 64, in of 4."""
  return (q.ndim == 2 and q.shape[0] % cpu_matmul.TILE_OUTPUTS == 0
          and q.shape[1] % cpu_matmul.TILE_INPUTS == 0)


def tile_int8(q) -> np.ndarray:
  """int8 rows q [out, in] (tileable) -> [out / 64, in / 4, 64, 4]: element [t, g, j, k]
  is q[64 t + j, 4 g + k], each tile's 64 outputs side by side per group of 4 inputs."""
  tiles, groups, outputs, inputs = cpu_matmul.tiled_int8_shape(*q.shape)
  return np.ascontiguousarray(
      np.asarray(q).reshape(tiles, outputs, groups, inputs).transpose(0, 2, 1, 3))


def _quantize_tree(tree: Mapping[str, Any], path: tuple[str, ...], tiled: bool) -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out[key] = _quantize_tree(value, path + (key,), tiled)
    elif key == KERNEL_T_PARAM and path[-2:] not in ENCODING_PROJECTIONS:
      q, out[KERNEL_SCALE] = quantize_rows(value)
      out[KERNEL_INT8] = tile_int8(q) if tiled and tileable(q) else q
    elif key == 'embedding' and path[-1:] == ('token_embedder',):
      q, out[EMBEDDING_SCALE] = quantize_rows(value)
      out[EMBEDDING_INT8] = tile_int8(q) if tiled and tileable(q) else q
    else:
      out[key] = np.asarray(value)
  return out


def int8_tree(params: Mapping[str, Any], tiled: bool | None = None) -> dict:
  """A bare params tree (kernels in either layout) with every projection kernel (but the
  encoding's cross-attention keys/values) and token embedding table in int8, as
  int8_decoder stores them; host (numpy) arrays. tiled: as int8_decoder."""
  if tiled is None:
    tiled = cpu_matmul.int8_tiles_apply()
  return _quantize_tree(transposed_kernels(params), (), tiled)


def int8_decoder(target_params: Mapping[str, Any], tiled: bool | None = None) -> dict:
  """{'params'} of an int8 draft: the target's decoder (its variables {'params': ...},
  kernels in either layout) without the encoder, every per-step matrix int8.

  tiled: store the matrices that tile in the kernel's tiles (tile_int8); None: where the
  kernel's tiled form computes them (jaxspec.model.cpu.matmul.int8_tiles_apply). Either
  form gives the same products bit for bit.
  The result is host (numpy) arrays; the draft is jaxspec.model.shared_encoder_draft's
  decoder over the target's encoding (jaxspec.decoding.drafters.int8).
  """
  if not isinstance(target_params, Mapping) or 'params' not in target_params:
    raise ValueError("int8_decoder takes the target's variables {'params': ...}")
  decoder = {name: tree for name, tree in target_params['params'].items() if name != 'encoder'}
  return {'params': int8_tree(decoder, tiled)}
