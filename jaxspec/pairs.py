"""The shipped model pairs by name, ready to decode text.

    from jaxspec import pairs
    pair = pairs.load('ende_local')                  # target + small draft, float32
    print(pair.translate('Open the file.'))          # speculative, greedy, gamma 3

A pair bundles the target's and the draft's `T5Config` (the gin-free twins of
gin/models/local_*.gin), their parameters read from the repository's checkpoints/,
the SentencePiece vocabulary and the task's prefix, so text goes in and text comes
out: `generate_text` (both tasks), `translate` (ende_local), `summarize`
(docsum_local), with the baseline or the speculative decoder.
"""

from __future__ import annotations

import dataclasses
import pathlib
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import errors, inference, paths, validation
from jaxspec.config import EOS_ID, T5Config, get_config
from jaxspec.data import corpora
from jaxspec.decoding.baseline import generate
from jaxspec.decoding import auto_gamma
from jaxspec.decoding.speculative import AUTO, SpeculativeConfig, speculative_generate
from jaxspec.decoding.drafters.t5 import T5Drafter
from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class PairSpec:
  """Where a named pair's parts are and the lengths its task was trained for."""
  task: str  # the shipped corpus: its task prefix
  input_length: int
  max_decode_length: int
  gamma: int = 3  # The main job's gamma for this pair.
  directory: str | None = None  # checkpoints/<directory>/ (default: the task's name)
  target: str = 'local_target'  # the target's get_config name
  default_draft: str = 'small'  # the draft `load` takes when none is named


PAIRS = {
    'ende_local': PairSpec('ende', input_length=64, max_decode_length=64),
    'docsum_local': PairSpec('docsum', input_length=256, max_decode_length=128),
    'ende54m_local': PairSpec('ende', input_length=64, max_decode_length=64,
                              directory='ende54m', target='local_target_54m',
                              default_draft='base'),
}
DRAFTS = ('small', 'base')  # checkpoints/<directory>/draft_<draft>, config local_draft_<draft>
DECODERS = ('speculative', 'baseline')


def default_checkpoint_dir() -> pathlib.Path:
  """$JAXSPEC_CHECKPOINT_DIR, else the working directory's or the checkout's checkpoints/
  (jaxspec.paths)."""
  return paths.checkpoint_dir()


@dataclasses.dataclass(frozen=True)
class Prediction:
  """One input's output."""
  input: str
  text: str  # the decoded prediction
  tokens: list[int]  # its ids, up to and including EOS
  target_calls: int  # target decode steps this row took (one per token for the baseline)


@dataclasses.dataclass(frozen=True, eq=False)
class Pair:
  """A target, its draft and the vocabulary, loaded (see `load`)."""
  name: str
  task: str
  target_config: T5Config
  draft_config: T5Config
  target_params: Any  # {'params': tree}
  draft_params: Any  # {'params': tree}
  vocabulary: corpora.Vocabulary
  input_length: int
  max_decode_length: int
  gamma: int
  # gamma='auto' decoders by (batch size, sampling, max_decode_length): calibrated once.
  _auto: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

  @property
  def drafter(self) -> T5Drafter:
    return T5Drafter(self.draft_config)

  def encode(self, texts: Sequence[str], overlong: str = 'truncate') -> np.ndarray:
    """Texts -> encoder tokens [len(texts), input_length]: the task prefix, the text and
    EOS, as the pair was trained. Longer inputs are cut with a warning ('truncate') or
    refused ('error'); empty ones are refused, naming them."""
    texts = _as_texts(texts)
    rows = [self.vocabulary.encode(corpora.TASK_PREFIXES[self.task] + t) for t in texts]
    tokens, truncated = inference.fit_inputs(rows, self.input_length, overlong)
    if truncated:
      warnings.warn(f'inputs {truncated[:10]} are longer than {self.input_length} tokens '
                    'and were truncated', stacklevel=3)
    return tokens

  def generate_text(self, texts: str | Sequence[str], *, decoder: str = 'speculative',
                    gamma: int | str | None = None, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int = 0, max_decode_length: int | None = None,
                    batch_size: int = 8, overlong: str = 'truncate') -> list[Prediction]:
    """Decodes each text with `decoder` ('speculative' or 'baseline'), in batches.

    Input i samples with fold_in(PRNGKey(seed), i), as scripts/infer.py does, so its
    output depends on neither the batch nor the other inputs. Greedy (temperature 0)
    speculative output is token for token the baseline's.

    gamma: drafts per target call (None: the pair's); 'auto' chooses it per batch, 0 (the
    baseline) included, from costs measured on this machine for this batch size
    (jaxspec.decoding.auto_gamma): the first call calibrates on the first batches, which
    compiles each candidate gamma once, and keeps the costs in the calibration cache
    ($JAXSPEC_CALIBRATION_DIR) for later processes.
    """
    if decoder not in DECODERS:
      raise ValueError(f'decoder must be one of {DECODERS}, got {decoder!r}')
    validation.check_integer('batch_size', batch_size, 1)
    validation.check_integer('seed', seed, 0, 2**32 - 1)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    validation.check_sampling_values(temperature, top_k, top_p)
    gamma = self.gamma if gamma is None else gamma
    max_decode_length = max_decode_length or self.max_decode_length
    texts = _as_texts(texts)
    tokens = self.encode(texts, overlong)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        jax.random.PRNGKey(seed), np.arange(len(texts)))
    size = min(batch_size, 1 << (len(texts) - 1).bit_length())  # One shape per bucket.
    batches = []
    for start in range(0, len(texts), size):
      rows = list(range(start, min(start + size, len(texts))))
      padded = rows + [rows[-1]] * (size - len(rows))
      batches.append((rows, (jnp.asarray(tokens[padded]), keys[np.asarray(padded)])))
    auto = None
    if decoder == 'speculative' and gamma == AUTO:
      auto = self._auto_decoder(size, sampling, max_decode_length)
      if auto.costs is None and not auto.load_calibration():
        auto.calibrate([batch for _, batch in batches[:max(2, -(-8 // size))]])
    predictions = []
    for rows, batch in batches:
      if auto is not None:
        result = auto(batch)
        output, row_calls = result.output, np.asarray(result.stats.row_target_calls)
      else:
        output, row_calls = self._decode(*batch, decoder, gamma, sampling, max_decode_length)
      for row, index in enumerate(rows):
        ids = inference.trim_at_eos(np.asarray(output.tokens[row]), EOS_ID)
        calls = len(ids) if row_calls is None else int(row_calls[row])
        predictions.append(Prediction(texts[index], self.vocabulary.decode(ids), ids, calls))
    return predictions

  def _auto_decoder(self, size, sampling, max_decode_length) -> auto_gamma.AutoGammaDecoder:
    """The gamma='auto' decoder of batches of `size` (made once per pair and setting)."""
    setting = (size, sampling, max_decode_length)
    if setting not in self._auto:
      self._auto[setting] = auto_gamma.AutoGammaDecoder(
          lambda batch: generate(self.target_params, *batch, config=self.target_config,
                                 max_decode_length=max_decode_length, sampling=sampling),
          lambda batch, spec: speculative_generate(
              self.target_params, self.draft_params, *batch,
              target_config=self.target_config, drafter=self.drafter, spec=spec,
              max_decode_length=max_decode_length, sampling=sampling),
          SpeculativeConfig(gamma=AUTO), batch_size=size,
          gammas=[g for g in auto_gamma.DEFAULT_GAMMAS if g < max_decode_length] or [1],
          key=auto_gamma.calibration_key(
              pair=self.name, target=repr(self.target_config), draft=repr(self.draft_config),
              sampling=repr(sampling), max_decode_length=max_decode_length,
              input_length=self.input_length),
          cache=auto_gamma.GammaCostCache())
    return self._auto[setting]

  def _decode(self, tokens, keys, decoder, gamma, sampling, max_decode_length):
    if decoder == 'baseline':
      return generate(self.target_params, tokens, keys, config=self.target_config,
                      max_decode_length=max_decode_length, sampling=sampling), None
    result = speculative_generate(
        self.target_params, self.draft_params, tokens, keys,
        target_config=self.target_config, drafter=self.drafter,
        spec=SpeculativeConfig(gamma=gamma), max_decode_length=max_decode_length,
        sampling=sampling)
    return result.output, np.asarray(result.stats.row_target_calls)

  def translate(self, text: str | Sequence[str], **options) -> str | list[str]:
    """English -> German (ende pairs): a string for a string, a list for a list.
    options: those of `generate_text`."""
    return self._texts('ende', 'translate', text, options)

  def summarize(self, text: str | Sequence[str], **options) -> str | list[str]:
    """Python code -> its docstring (docsum pairs): a string for a string, a list for a
    list. options: those of `generate_text`."""
    return self._texts('docsum', 'summarize', text, options)

  def _texts(self, task, method, text, options):
    if self.task != task:
      other = {'ende': 'translate', 'docsum': 'summarize'}[self.task]
      raise ValueError(f'{self.name} is a {self.task} pair; use .{other}() or '
                       f'.generate_text(), or load a {task} pair for .{method}()')
    predictions = self.generate_text(text, **options)
    texts = [p.text for p in predictions]
    return texts[0] if isinstance(text, str) else texts


def _as_texts(texts: str | Sequence[str]) -> list[str]:
  """A string or a sequence of strings -> a list of non-empty strings, or ValueError."""
  if isinstance(texts, str):
    texts = [texts]
  texts = list(texts)
  if not texts:
    raise ValueError('no text to decode: got an empty list')
  for index, text in enumerate(texts):
    if not isinstance(text, str):
      raise ValueError(f'input {index} is {type(text).__name__}, not text')
    if not text.strip():
      raise ValueError(f'input {index} is empty or whitespace only: {text!r}')
  return texts


def load(name: str, draft: str | None = None, *, dtype: str = 'float32',
         checkpoint_dir: str | pathlib.Path | None = None) -> Pair:
  """The named pair ('ende_local', 'docsum_local' or 'ende54m_local') with the `draft`
  ('small' or 'base'; None: the pair's default, base for ende54m_local and small for
  the others), parameters in `dtype` (float32 on CPU, bfloat16 on TPU/GPU). Where XLA
  computes the target (bfloat16, an accelerator) its steps are fixed-width
  (decode_positions 10: gamma up to 9), so greedy outputs stay the baseline's.

  checkpoint_dir: the directory holding <directory>/target and
  <directory>/draft_<draft> (default: $JAXSPEC_CHECKPOINT_DIR, else the working
  directory's or the source checkout's checkpoints/, jaxspec.paths).
  """
  if name not in PAIRS:
    raise KeyError(f'unknown pair {name!r}; known: {sorted(PAIRS)}')
  spec = PAIRS[name]
  draft = spec.default_draft if draft is None else draft
  if draft not in DRAFTS:
    raise ValueError(f'draft must be one of {DRAFTS}, got {draft!r}')
  root = pathlib.Path(checkpoint_dir or default_checkpoint_dir()) / (spec.directory or spec.task)
  if not root.is_dir():
    raise errors.MissingFile(
        f"no checkpoints for {name} at {root}: the shipped pairs live in a checkout's "
        f'checkpoints/ directory; run from the checkout, set ${paths.CHECKPOINT_DIR_ENV} '
        'or pass checkpoint_dir')
  target_config = get_config(spec.target, dtype=dtype, param_dtype=dtype)
  if not cpu_matmul.exact_across_widths(dtype, target_config.cpu_matmul):
    # Fixed-width target steps as wide as the widest verify step of any gamma the pair
    # runs, so greedy outputs stay the baseline's (T5Config.decode_positions).
    target_config = target_config.replace(
        decode_positions=max(spec.gamma, *auto_gamma.DEFAULT_GAMMAS) + 1)
  draft_config = get_config(f'local_draft_{draft}', dtype=dtype, param_dtype=dtype)
  return Pair(
      name=name, task=spec.task, target_config=target_config, draft_config=draft_config,
      target_params=inference.load_model_params(str(root / 'target'), target_config,
                                                for_decoding=True),
      draft_params=inference.load_model_params(str(root / f'draft_{draft}'), draft_config,
                                               for_decoding=True),
      vocabulary=corpora.Vocabulary(), input_length=spec.input_length,
      max_decode_length=spec.max_decode_length, gamma=spec.gamma)
