"""RoBERTa and XLM-RoBERTa encoders (multilingual-e5, bge-m3; bge-reranker-base/large as
cross-encoders): BERT's encoder with positions counted from past the padding id and a single
segment, its tensors under roberta.*, and a classification head of its own names."""
from __future__ import annotations

from typing import Any

from engine.execution.models.bert import BertForSequenceClassification, BertModel


class RobertaModel(BertModel):
    BASE_PREFIX = "roberta."
    #: One segment (type_vocab_size 1): XLM-R's tokenizer makes no token types for a pair, and the
    #: model has a single type embedding, which every token adds.
    uses_token_types = False

    @classmethod
    def _position_offset(cls, hf: Any) -> int:
        """transformers numbers an unpadded prompt's positions from padding_idx + 1 (its position
        table has that many rows more than the longest prompt: 514 for 512)."""
        return hf.pad_token_id + 1


class RobertaForSequenceClassification(RobertaModel, BertForSequenceClassification):
    """A cross-encoder: RobertaClassificationHead's dense + tanh over the <s> state, then its
    out_proj, which score_head runs as BERT's pooler and classifier."""

    HEAD_NAMES = {"classifier.dense": "pooler", "classifier.out_proj": "classifier"}
