"""Drafters: what proposes tokens for the target to verify. `Drafter` (base.py) is the
interface; each module one kind of drafter."""

from jaxspec.decoding.drafters.base import DraftContext, Drafter, DraftSources, draw_tokens
from jaxspec.decoding.drafters.feature import FeatureDrafter
from jaxspec.decoding.drafters.int8 import Int8Drafter
from jaxspec.decoding.drafters.ngram import (BigramDrafter, UnigramDrafter, fit_bigram,
                                             fit_unigram)
from jaxspec.decoding.drafters.prompt_lookup import PromptLookupDrafter
from jaxspec.decoding.drafters.shared_encoder import (SharedEncoderDrafter,
                                                      SharedEncoderDrafterWithTarget)
from jaxspec.decoding.drafters.staged import StagedDrafter, StageStats
from jaxspec.decoding.drafters.t5 import T5Drafter

__all__ = ['BigramDrafter', 'DraftContext', 'DraftSources', 'Drafter', 'FeatureDrafter',
           'Int8Drafter',
           'PromptLookupDrafter', 'SharedEncoderDrafter', 'SharedEncoderDrafterWithTarget',
           'StageStats', 'StagedDrafter', 'T5Drafter', 'UnigramDrafter', 'draw_tokens',
           'fit_bigram', 'fit_unigram']
