"""Task metrics, as T5's tasks report them: corpus BLEU (sacrebleu) and ROUGE."""

from __future__ import annotations

from typing import Sequence


def bleu(targets: Sequence[str], predictions: Sequence[str]) -> float:
  """Corpus BLEU with sacrebleu's defaults (13a tokenization), as t5's `bleu` metric."""
  import sacrebleu
  return float(sacrebleu.corpus_bleu(list(predictions), [list(targets)]).score)


def rouge(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """Mean ROUGE-1/2/Lsum F-measure over the examples x 100, as t5's `rouge` metric.

  The plain mean, where t5 reports the middle of a bootstrap resampling (an estimate of
  the same mean that changes from run to run): equal predictions score equally.
  """
  from rouge_score import rouge_scorer
  names = ('rouge1', 'rouge2', 'rougeLsum')
  scorer = rouge_scorer.RougeScorer(list(names))
  # rougeLsum splits summaries at newlines.
  scores = [scorer.score(target.replace('. ', '.\n'), prediction.replace('. ', '.\n'))
            for target, prediction in zip(targets, predictions)]
  return {name: 100.0 * sum(s[name].fmeasure for s in scores) / max(len(scores), 1)
          for name in names}


TASK_METRICS = {'ende': 'bleu', 'docsum': 'rouge'}


def task_metric(corpus: str, targets: Sequence[str], predictions: Sequence[str]) -> dict:
  if TASK_METRICS.get(corpus) == 'bleu':
    return {'bleu': bleu(targets, predictions)}
  return rouge(targets, predictions)
