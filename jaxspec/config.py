"""Model configuration: a frozen `T5Config` and the named sizes.

The named sizes are those of the public T5X checkpoints (T5.1.1 and T5 1.0), the
shipped local models (`local_target`, `local_draft_small`, `local_draft_base`) and
small configurations used by tests. Each config is hashable, so it can be a static
argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.errors import InvalidSetting

PAD_ID = 0  # Padding, and the decoder start token.
EOS_ID = 1
UNK_ID = 2
# T5Config.cpu_matmul: jaxspec's few-row CPU kernel where it applies, or XLA's einsum
# everywhere (jaxspec.model.cpu.matmul).
CPU_MATMUL_KERNEL = 'kernel'
CPU_MATMUL_XLA = 'xla'
CPU_MATMULS = (CPU_MATMUL_KERNEL, CPU_MATMUL_XLA)
# T5Config.decode_attention: how a decode step attends where XLA computes it (everywhere
# but jaxspec's CPU kernel): jaxspec's own products, or jax.nn.dot_product_attention
# with a fused kernel where the platform has one (jaxspec.model.accelerator.attention).
DECODE_ATTENTION_EINSUM = 'einsum'
DECODE_ATTENTION_JAX = 'dot_product_attention'
DECODE_ATTENTIONS = (DECODE_ATTENTION_EINSUM, DECODE_ATTENTION_JAX)


# Metadata of a dataclass field added after runs were recorded: run settings
# (inference.describe) leave it out at its default, so earlier records keep their
# fingerprint.
OMIT_AT_DEFAULT = {'settings': 'omit at default'}


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Architecture and numerics of a T5 encoder-decoder."""

  vocab_size: int = 32128
  emb_dim: int = 512
  num_heads: int = 6
  head_dim: int = 64
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  mlp_dim: int = 1024
  # ('gelu', 'linear') is T5.1.1's gated GELU; ('relu',) is T5 1.0.
  mlp_activations: tuple[str, ...] = ('gelu', 'linear')
  # True (T5 1.0): logits through the tied embedding, scaled by 1/sqrt(emb_dim).
  logits_via_embedding: bool = False
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  # Compute dtype of activations and matmuls; norms, softmax and logits stay float32.
  dtype: str = 'float32'
  # Dtype in which parameters are created (loaded ones keep their own dtype).
  param_dtype: str = 'float32'
  # Products of a few positions with transposed kernels or the embedding on CPU:
  # 'kernel' (jaxspec.model.cpu.matmul's few-row kernel, where it applies) or 'xla'.
  cpu_matmul: str = CPU_MATMUL_KERNEL
  # Fixed-width decode steps (0: off). Every cached decode step of fewer positions runs
  # over this many, the rest padding whose logits are dropped, and the self-attention
  # reads every key at its own cache slot. Then a speculative verify step computes each
  # position with the very shapes of the baseline's one-position steps, so XLA's products
  # round alike and greedy outputs stay the baseline's token for token in bfloat16 and on
  # accelerators (docs/design.md, "Exactness, and where floating point can bite"). Set
  # it to the widest verify step (gamma + 1) in the target config both decoders share;
  # nearly free where a step is memory-bound (a GPU, a TPU), not on a CPU, whose float32
  # kernels are exact without it.
  decode_positions: int = dataclasses.field(default=0, metadata=OMIT_AT_DEFAULT)
  # A decode step's attention where XLA computes it: 'einsum' (jaxspec's products, a
  # softmax between them) or 'dot_product_attention' (jax.nn.dot_product_attention:
  # cuDNN's fused kernel on NVIDIA GPUs in bfloat16 / float16, else JAX's choice).
  # Both decoders of a speculative run share the target's, so greedy outputs stay
  # identical with either; the CPU kernel, where it runs, takes precedence.
  decode_attention: str = dataclasses.field(default=DECODE_ATTENTION_EINSUM,
                                            metadata=OMIT_AT_DEFAULT)
  # Training only (T5X's dropout_rate): the rate at which a T5 built with
  # deterministic=False drops activations (jaxspec.model.t5); decoding never drops.
  dropout_rate: float = dataclasses.field(default=0.0, metadata=OMIT_AT_DEFAULT)

  def __post_init__(self):
    if self.mlp_activations not in (('gelu', 'linear'), ('relu',)):
      raise InvalidSetting(
          "mlp_activations must be ('gelu', 'linear') (T5.1.1) or ('relu',) (T5 1.0),"
          f' got {self.mlp_activations!r}')
    for name in ('vocab_size', 'emb_dim', 'num_heads', 'head_dim', 'mlp_dim',
                 'num_encoder_layers', 'num_decoder_layers'):
      if getattr(self, name) < 1:
        raise InvalidSetting(f'{name} must be >= 1, got {getattr(self, name)}')
    for name in ('dtype', 'param_dtype'):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError:
        raise InvalidSetting(f"{name} must name a dtype ('float32', 'bfloat16', ...), got "
                             f'{getattr(self, name)!r}') from None
    check_cpu_matmul(self.cpu_matmul)
    if self.decode_attention not in DECODE_ATTENTIONS:
      raise ValueError(f'decode_attention must be one of {DECODE_ATTENTIONS}, got '
                       f'{self.decode_attention!r}')
    if self.decode_positions < 0:
      raise InvalidSetting(f'decode_positions must be >= 0 (0: off), got {self.decode_positions}')
    if not 0.0 <= self.dropout_rate < 1.0:
      raise InvalidSetting(f'dropout_rate must be in [0, 1), got {self.dropout_rate}')

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def replace(self, **changes) -> 'T5Config':
    return dataclasses.replace(self, **changes)


def check_cpu_matmul(cpu_matmul: str) -> None:
  if cpu_matmul not in CPU_MATMULS:
    raise InvalidSetting(f'cpu_matmul must be one of {CPU_MATMULS}, got {cpu_matmul!r}')


def _t5_1_1(emb_dim, num_heads, num_layers, mlp_dim) -> T5Config:
  return T5Config(
      emb_dim=emb_dim, num_heads=num_heads, head_dim=64,
      num_encoder_layers=num_layers, num_decoder_layers=num_layers, mlp_dim=mlp_dim,
      mlp_activations=('gelu', 'linear'), logits_via_embedding=False)


def _t5_1_0(emb_dim, num_heads, head_dim, num_layers, mlp_dim) -> T5Config:
  return T5Config(
      emb_dim=emb_dim, num_heads=num_heads, head_dim=head_dim,
      num_encoder_layers=num_layers, num_decoder_layers=num_layers, mlp_dim=mlp_dim,
      mlp_activations=('relu',), logits_via_embedding=True)


def _local(emb_dim, num_heads, head_dim, num_layers, mlp_dim,
           num_decoder_layers=None) -> T5Config:
  """The shipped local models: gated GELU with logits through the tied embedding,
  over the shipped 8000-piece vocabulary (num_layers encoder layers, and as many decoder
  layers unless num_decoder_layers says)."""
  return T5Config(
      vocab_size=8000, emb_dim=emb_dim, num_heads=num_heads, head_dim=head_dim,
      num_encoder_layers=num_layers,
      num_decoder_layers=num_layers if num_decoder_layers is None else num_decoder_layers,
      mlp_dim=mlp_dim, mlp_activations=('gelu', 'linear'), logits_via_embedding=True)


NAMED_CONFIGS: dict[str, T5Config] = {
    't5_1_1_small': _t5_1_1(512, 6, 8, 1024),
    't5_1_1_base': _t5_1_1(768, 12, 12, 2048),
    't5_1_1_large': _t5_1_1(1024, 16, 24, 2816),
    't5_1_1_xl': _t5_1_1(2048, 32, 24, 5120),
    't5_1_1_xxl': _t5_1_1(4096, 64, 24, 10240),
    't5_small': _t5_1_0(512, 8, 64, 6, 2048),
    't5_base': _t5_1_0(768, 12, 64, 12, 3072),
    't5_large': _t5_1_0(1024, 16, 64, 24, 4096),
    't5_3B': _t5_1_0(1024, 32, 128, 24, 16384),
    't5_11B': _t5_1_0(1024, 128, 128, 24, 65536),
    # The shipped local pairs (checkpoints/, jaxspec.pairs): gin/models/local_*.gin.
    'local_target': _local(256, 4, 64, 4, 768),
    'local_draft_small': _local(64, 2, 32, 2, 256),
    'local_draft_base': _local(128, 4, 32, 3, 512),
    # Larger local targets (gin/models/local_target_45m.gin; 150m for step costs only).
    'local_target_45m': _local(512, 8, 64, 6, 1024),
    'local_target_150m': _local(768, 12, 64, 8, 2048),
    # A deep-decoder target sized by step costs (gin/models/local_target_54m.gin): its
    # per-step decoder weights (168 MB in float32) exceed what the 2-core machines'
    # L3 serves at full speed while its int8 draft's (42 MB) do not.
    'local_target_54m': _local(512, 8, 64, 2, 2048, num_decoder_layers=8),
    # Tiny configurations for tests: fast on CPU, both variants.
    'test_tiny_1_1': T5Config(
        vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, num_encoder_layers=2,
        num_decoder_layers=2, mlp_dim=48, mlp_activations=('gelu', 'linear'),
        logits_via_embedding=False),
    'test_tiny_1_0': T5Config(
        vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, num_encoder_layers=2,
        num_decoder_layers=3, mlp_dim=48, mlp_activations=('relu',),
        logits_via_embedding=True),
}


def get_config(name: str, **overrides) -> T5Config:
  """Returns the named config, with fields replaced by `overrides` (e.g. dtype)."""
  if name not in NAMED_CONFIGS:
    raise KeyError(f'unknown model config {name!r}; known: {sorted(NAMED_CONFIGS)}')
  return dataclasses.replace(NAMED_CONFIGS[name], **overrides)
