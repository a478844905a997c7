"""jaxspec.measure.metrics: ROUGE as the plain mean over examples (equal predictions score
equally, run after run), BLEU as sacrebleu's corpus BLEU."""

import pytest
from rouge_score import rouge_scorer

from jaxspec.measure import metrics

TARGETS = ['Return the number of items.', 'Open the file and read it.', 'Close the socket.',
           'Parse a date string. Return a datetime.', 'Yield the lines of a file.']
PREDICTIONS = ['Return the number.', 'Read the file.', 'Close the socket now.',
               'Parse a string.', 'Return the lines.']


def test_rouge_is_the_mean_of_the_per_example_f_measures():
  scorer = rouge_scorer.RougeScorer(['rouge1', 'rouge2'])
  per_example = [scorer.score(t, p) for t, p in zip(TARGETS, PREDICTIONS)]
  result = metrics.rouge(TARGETS, PREDICTIONS)
  for name in ('rouge1', 'rouge2'):
    expected = 100 * sum(s[name].fmeasure for s in per_example) / len(per_example)
    assert result[name] == pytest.approx(expected)
  assert set(result) == {'rouge1', 'rouge2', 'rougeLsum'}


def test_rouge_of_equal_predictions_is_equal_every_time():
  runs = [metrics.rouge(TARGETS * 20, PREDICTIONS * 20) for _ in range(5)]
  assert all(run == runs[0] for run in runs)


def test_perfect_and_empty_scores():
  assert metrics.rouge(TARGETS, TARGETS) == {'rouge1': 100.0, 'rouge2': 100.0, 'rougeLsum': 100.0}
  assert metrics.rouge([], []) == {'rouge1': 0.0, 'rouge2': 0.0, 'rougeLsum': 0.0}
  assert metrics.bleu(TARGETS, TARGETS) == pytest.approx(100.0)
