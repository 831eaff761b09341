"""BERT encoders at the model level: our BertModel over a step's packed prompts equals
transformers' BertModel run on each prompt alone, and a cross-encoder's score_head over the
[CLS] states of (query, document) pairs, told apart by token types, equals transformers'
logits and sentence-transformers' CrossEncoder.predict().

Tiny random checkpoints (tests/tiny_bert.py) with a WordPiece tokenizer, built offline.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.execution.attention import AttentionMetadata, PrefillSeqMeta
from engine.execution.models import model_class
from engine.execution.models.bert import BertForSequenceClassification, BertModel
from engine.execution.models.roberta import RobertaForSequenceClassification, RobertaModel
from engine.execution.weights.checkpoint import iter_weights
from tests.tiny_bert import build_tiny_bert_cross_encoder, build_tiny_bert_embedder

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 3, "a",
         "What is the capital of France?"]
PAIRS = [("what is the capital of france?", "Paris is the capital and largest city of France."),
         ("what is the capital of france?", "The quick brown fox jumps over the lazy dog."),
         ("hello", "a paged KV cache stores keys and values in fixed-size blocks"),
         ("numbers", "0 1 2 3")]


FAMILIES = ["bert", "xlm-roberta"]


@pytest.fixture(scope="module")
def embedder_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {family: build_tiny_bert_embedder(root / family, family=family) for family in FAMILIES}


@pytest.fixture(scope="module")
def cross_encoder_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cross-encoders")
    return {family: build_tiny_bert_cross_encoder(root / family, family=family) for family in FAMILIES}


@pytest.fixture(scope="module")
def embedder_dir(embedder_dirs: dict[str, Path]) -> Path:
    return embedder_dirs["bert"]


@pytest.fixture(scope="module")
def cross_encoder_dir(cross_encoder_dirs: dict[str, Path]) -> Path:
    return cross_encoder_dirs["bert"]


def _load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(model_dir))
    cls = model_class(hf.model_type, hf.architectures)
    model = cls(cls.config_from_hf(hf))
    model.load_weights(iter_weights(model_dir))
    return model.eval()


def _packed_step(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """The prompts as one step's packed prefill rows: input ids, positions, metadata, and each
    prompt's first row."""
    starts = np.cumsum([0] + [len(p) for p in prompts])[:-1].tolist()
    metas = [PrefillSeqMeta(query_start=s, query_len=len(p), context_len=len(p), context_slots=None)
             for s, p in zip(starts, prompts, strict=True)]
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    attn = AttentionMetadata(slot_mapping=None, num_prefill_tokens=len(input_ids), prefill=metas)
    return input_ids, positions, attn, starts


def test_registry_picks_the_task_head_by_architecture(embedder_dirs: dict[str, Path],
                                                     cross_encoder_dirs: dict[str, Path]) -> None:
    assert type(_load(embedder_dirs["bert"])) is BertModel
    assert type(_load(cross_encoder_dirs["bert"])) is BertForSequenceClassification
    assert type(_load(embedder_dirs["xlm-roberta"])) is RobertaModel
    assert type(_load(cross_encoder_dirs["xlm-roberta"])) is RobertaForSequenceClassification


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_prompts_equal_transformers_each_alone(embedder_dirs: dict[str, Path], family: str) -> None:
    """Four prompts of different lengths in one step (bidirectional within each, nothing across):
    every token's hidden state equals transformers' on that prompt alone (XLM-R's positions
    counted from past its padding id)."""
    from transformers import AutoModel, AutoTokenizer

    embedder_dir = embedder_dirs[family]
    tokenizer = AutoTokenizer.from_pretrained(str(embedder_dir))
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts) and prompts[0][0] == tokenizer.cls_token_id
    reference = AutoModel.from_pretrained(str(embedder_dir)).eval()
    model = _load(embedder_dir)
    input_ids, positions, attn, starts = _packed_step(prompts)
    with torch.inference_mode():
        hidden = model(input_ids, positions, attn, [])
        for prompt, start in zip(prompts, starts, strict=True):
            expected = reference(torch.tensor([prompt])).last_hidden_state[0]
            torch.testing.assert_close(hidden[start : start + len(prompt)], expected, atol=1e-5, rtol=1e-5)
        # one prompt alone takes the unpadded path: the same values
        alone = model(*_packed_step(prompts[1:2])[:3], [])
        torch.testing.assert_close(alone, hidden[starts[1] : starts[1] + len(prompts[1])], atol=1e-5, rtol=1e-5)


def test_output_rows_run_the_last_layer_for_those_rows_alone(embedder_dir: Path) -> None:
    """output_rows (each prompt's first or last row): those rows equal the full forward's; the
    last layer ran for them alone, so every other row holds the layer before's states."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embedder_dir))
    prompts = [tokenizer.encode(t) for t in TEXTS]
    model = _load(embedder_dir)
    input_ids, positions, attn, starts = _packed_step(prompts)
    # the first prompt's [CLS] row, the others' last rows
    rows = torch.tensor([starts[0]] + [s + len(p) - 1 for s, p in zip(starts[1:], prompts[1:], strict=True)])
    with torch.inference_mode():
        full = model(input_ids, positions, attn, [])
        got = model(input_ids, positions, attn, [], output_rows=rows)
        last = model.layers[-1]
        model.layers = model.layers[:-1]
        before_last = model(input_ids, positions, attn, [])
        model.layers.append(last)
    torch.testing.assert_close(got[rows], full[rows], atol=1e-6, rtol=1e-6)
    others = torch.ones(len(input_ids), dtype=torch.bool)
    others[rows] = False
    torch.testing.assert_close(got[others], before_last[others], atol=0, rtol=0)
    assert not torch.allclose(before_last[rows], full[rows], atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_encoder_scores_equal_transformers_and_sentence_transformers(cross_encoder_dirs: dict[str, Path],
                                                                          family: str) -> None:
    """(query, document) pairs packed in one step with their token types (BERT's; XLM-R has a
    single segment): score_head over each [CLS] state equals transformers' logits, and after a
    sigmoid CrossEncoder.predict()."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cross_encoder_dir = cross_encoder_dirs[family]
    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder_dir))
    encoded = [tokenizer(q, d) for q, d in PAIRS]
    prompts = [e["input_ids"] for e in encoded]
    model = _load(cross_encoder_dir)
    input_ids, positions, attn, starts = _packed_step(prompts)
    token_types = None
    if family == "bert":
        assert model.uses_token_types
        token_types = torch.tensor([t for e in encoded for t in e["token_type_ids"]])
        assert token_types.any() and not token_types.all()  # both segments present
    else:
        assert not model.uses_token_types and "token_type_ids" not in encoded[0]
    with torch.inference_mode():
        hidden = model(input_ids, positions, attn, [], token_type_ids=token_types)
        scores = model.score_head(hidden[starts].float())  # [pairs, 1]
        without_types = model.score_head(model(input_ids, positions, attn, [])[starts].float())
    assert scores.dtype == torch.float32 and scores.shape == (len(PAIRS), 1)
    reference = AutoModelForSequenceClassification.from_pretrained(str(cross_encoder_dir)).eval()
    with torch.inference_mode():
        logits = torch.cat([reference(**tokenizer(q, d, return_tensors="pt")).logits for q, d in PAIRS])
    torch.testing.assert_close(scores, logits, atol=1e-5, rtol=0)
    if family == "bert":
        assert (without_types - logits).abs().max() > 1e-3  # the token types matter
    predicted = CrossEncoder(str(cross_encoder_dir), device="cpu").predict(PAIRS)
    np.testing.assert_allclose(torch.sigmoid(scores[:, 0]).numpy(), predicted, atol=1e-5, rtol=0)


def test_checkpoint_errors_name_the_tensor(cross_encoder_dir: Path, embedder_dir: Path) -> None:
    from transformers import AutoConfig

    weights = dict(iter_weights(cross_encoder_dir))
    cls = model_class("bert", ["BertForSequenceClassification"])
    config = cls.config_from_hf(AutoConfig.from_pretrained(str(cross_encoder_dir)))
    with pytest.raises(ValueError, match="missing weights: classifier.weight"):
        cls(config).load_weights((k, v) for k, v in weights.items() if k != "classifier.weight")
    with pytest.raises(ValueError, match="bert.pooler.dense.weight.*shape"):
        cls(config).load_weights({**weights, "bert.pooler.dense.weight": torch.zeros(3, 3)}.items())
    with pytest.raises(ValueError, match="unexpected weight 'bert.encoder.layer.9"):
        cls(config).load_weights({**weights, "bert.encoder.layer.9.output.dense.weight": torch.zeros(1)}.items())
    # an embedder's checkpoint carries the pooler unused, and the pre-training heads are ignored
    base = dict(iter_weights(embedder_dir))
    assert "pooler.dense.weight" in base
    model = BertModel(BertModel.config_from_hf(AutoConfig.from_pretrained(str(embedder_dir))))
    model.load_weights({**base, "cls.predictions.bias": torch.zeros(1)}.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_kernels_path_equals_transformers(kernels, embedder_dirs: dict[str, Path], family: str) -> None:
    """The CPU backend's own path for an encoder: float32 panels whose products carry the GELU
    (up_proj) and the residual add + LayerNorm (o_proj, down_proj), and the packed bidirectional
    attention kernel reading each prompt's q/k/v in place; hidden states equal transformers'."""
    from transformers import AutoModel, AutoTokenizer

    from engine.execution.backends.cpu_attention import CpuAttention
    from engine.execution.backends.cpu_linear import pack_linears
    from engine.execution.kernels import ISAS

    isa = kernels.best_isa()
    if isa < ISAS["avx512"]:
        pytest.skip("the encoder attention kernel runs the AVX-512 prefill tiles")
    embedder_dir = embedder_dirs[family]
    tokenizer = AutoTokenizer.from_pretrained(str(embedder_dir))
    prompts = [tokenizer.encode(t) for t in TEXTS]
    reference = AutoModel.from_pretrained(str(embedder_dir)).eval()
    model = _load(embedder_dir)
    pack_linears(model, False, torch.float32, kernels, isa, 1 << 30)  # the panels alone, for every step
    input_ids, positions, attn, starts = _packed_step(prompts)
    attn.backend = CpuAttention(kernels, isa, prefill_in_cpp=True)
    with torch.inference_mode():
        hidden = model(input_ids, positions, attn, [])
        for prompt, start in zip(prompts, starts, strict=True):
            expected = reference(torch.tensor([prompt])).last_hidden_state[0]
            torch.testing.assert_close(hidden[start : start + len(prompt)], expected, atol=1e-5, rtol=1e-5)
        # the [CLS] rows alone through the last layer's fused epilogues: the same states
        cls_rows = torch.tensor(starts)
        pooled = model(input_ids, positions, attn, [], output_rows=cls_rows)[cls_rows]
        torch.testing.assert_close(pooled, hidden[cls_rows], atol=1e-5, rtol=1e-5)
