"""Named pairs: their configs are the gin model files' exactly, load() reads the
shipped checkpoints, and text in -> text out equals encoding by hand, decoding with
the public decoders and detokenizing (speculative token-identical to the baseline)."""

import os

import gin
import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import gin_flags
import jaxspec.configurables  # noqa: E402,F401
from jaxspec import get_config, pairs  # noqa: E402
from jaxspec.checkpoints.t5x import load_t5x_checkpoint  # noqa: E402
from jaxspec.config import EOS_ID  # noqa: E402
from jaxspec.data import corpora  # noqa: E402
from jaxspec.decoding.baseline import generate  # noqa: E402
from jaxspec.model import init_params  # noqa: E402
from jaxspec.model.cpu import layout as kernel_layout, matmul as cpu_matmul
from jaxspec.sampling import SamplingConfig


@pytest.mark.parametrize('model', ['target', 'draft_small', 'draft_base', 'target_45m',
                                   'target_54m'])
def test_local_configs_equal_the_gin_model_files(model):
  gin.clear_config()
  try:
    gin_flags.parse([f'--gin_file=gin/models/local_{model}.gin'])
    from_gin = gin.query_parameter('%MODEL').scoped_configurable_fn()
  finally:
    gin.clear_config()
  assert get_config(f'local_{model}') == from_gin


def test_load_reads_the_shipped_checkpoints():
  pair = pairs.load('docsum_local', 'base')
  expected = load_t5x_checkpoint(os.path.join(REPO, 'checkpoints/docsum/draft_base'),
                                 pair.draft_config)
  # Both models are held in the layout they decode fastest in (transposed on CPU).
  expected = kernel_layout.for_decoding(expected)
  jax.tree_util.tree_map(np.testing.assert_array_equal, pair.draft_params['params'], expected)
  # Steps as wide as their tokens where the kernels compute float32 exactly alike at any
  # width, else fixed-width steps for gamma up to 9 (T5Config.decode_positions).
  width = 0 if cpu_matmul.exact_across_widths('float32', cpu_matmul.KERNEL) else 10
  assert pair.target_config == get_config('local_target', decode_positions=width)
  assert (pair.input_length, pair.max_decode_length, pair.gamma) == (256, 128, 3)
  assert pairs.load('docsum_local', dtype='bfloat16').target_config.decode_positions == 10
  with pytest.raises(ValueError, match=r'docsum_local is a docsum pair; use .summarize\(\)'):
    pair.translate('x = 1')
  with pytest.raises(KeyError, match=r"unknown pair 'ende'; known: \['docsum_local', "):
    pairs.load('ende')


@pytest.fixture(scope='module')
def tiny_pair():
  """The ende pair's vocabulary and lengths with tiny random models (fast to compile)."""
  target = get_config('test_tiny_1_1', vocab_size=8000)
  draft = get_config('test_tiny_1_0', vocab_size=8000)
  return pairs.Pair(
      name='ende_local', task='ende', target_config=target, draft_config=draft,
      target_params=init_params(target, jax.random.PRNGKey(0)),
      draft_params=init_params(draft, jax.random.PRNGKey(1)),
      vocabulary=corpora.Vocabulary(), input_length=16, max_decode_length=8, gamma=3)


TEXTS = ['Open the file.', 'Save changes to the document?', 'Quit']


def test_generate_text_equals_encoding_decoding_and_detokenizing_by_hand(tiny_pair):
  vocab = corpora.Vocabulary()
  rows = [corpora.trim_and_append_eos(vocab.encode('translate English to German: ' + t), 16)
          for t in TEXTS]
  tokens = np.zeros((4, 16), np.int32)  # Batch bucket 4: the third row repeated.
  for i, row in enumerate(rows + rows[-1:]):
    tokens[i, :len(row)] = row
  by_hand = generate(tiny_pair.target_params, tokens, config=tiny_pair.target_config,
                     max_decode_length=8)
  speculative = tiny_pair.generate_text(TEXTS)
  baseline = tiny_pair.generate_text(TEXTS, decoder='baseline')
  for row, (spec, base) in enumerate(zip(speculative, baseline)):
    expected = [int(t) for t in by_hand.tokens[row]]
    expected = expected[:expected.index(EOS_ID) + 1] if EOS_ID in expected else expected
    assert spec.tokens == base.tokens == expected
    assert spec.text == base.text == vocab.decode(expected) and spec.input == TEXTS[row]
    assert base.target_calls == len(expected) >= spec.target_calls >= 1
  assert tiny_pair.translate(TEXTS[0]) == speculative[0].text
  assert tiny_pair.translate(TEXTS) == [p.text for p in speculative]


def test_sampled_text_depends_on_the_input_index_not_the_batch(tiny_pair):
  together = tiny_pair.generate_text(TEXTS, temperature=1.0, seed=3, batch_size=4)
  one_by_one = tiny_pair.generate_text(TEXTS, temperature=1.0, seed=3, batch_size=1)
  assert [p.tokens for p in together] == [p.tokens for p in one_by_one]


@pytest.mark.parametrize('texts, message', [
    (['Open', '  '], r"input 1 is empty or whitespace only: '  '"),
    ([], 'no text to decode'),
    ([b'Open'], 'input 0 is bytes, not text'),
])
def test_bad_text_is_refused_by_name(tiny_pair, texts, message):
  with pytest.raises(ValueError, match=message):
    tiny_pair.generate_text(texts)


def test_auto_gamma_text_is_the_baselines_and_its_calibration_is_kept(
    tiny_pair, tmp_path, monkeypatch):
  monkeypatch.setenv('JAXSPEC_CALIBRATION_DIR', str(tmp_path))
  texts = TEXTS + ['Close the window.']
  auto = tiny_pair.generate_text(texts, gamma='auto', batch_size=2)
  baseline = tiny_pair.generate_text(texts, decoder='baseline', batch_size=2)
  assert [p.tokens for p in auto] == [p.tokens for p in baseline]
  decoder = tiny_pair._auto[(2, SamplingConfig(), 8)]  # pylint: disable=protected-access
  assert sum(decoder.gamma_counts.values()) == 2  # both batches, whichever gamma
  assert len(list(tmp_path.glob('*.json'))) == 1
