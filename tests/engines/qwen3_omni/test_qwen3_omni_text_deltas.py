"""The thinkers' streamed text (``answer.TextDeltas``): the deltas of an answer fed a token at a
time join into the whole answer's decode (a prefix of it while the answer ends inside a UTF-8
character), for the tiny folder's byte-level BPE (multi-byte characters split across tokens,
random ids, special tokens) and a SentencePiece-style tokenizer (a word's leading space at a
window's start); and each step decodes a window of a few tokens, not the whole answer."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from omni_mesh.engines.hf.folders import resolve_folder
from omni_mesh.engines.qwen3_omni.answer import TextDeltas

pytestmark = [pytest.mark.unit]

TEXT = "héllo wörld, 你好世界 🙂 — the sea is calm; ünïcödé ok"


class CountingTokenizer:
    """A tokenizer whose decodes are recorded (the longest window decoded)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return str(self.tokenizer.decode(ids, **kwargs))


def streamed(tokenizer: Any, ids: list[int]) -> str:
    deltas = TextDeltas(tokenizer)
    for n in range(1, len(ids) + 1):
        deltas.delta(ids[:n])
    return deltas.sent


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(resolve_folder("tiny-qwen3-omni")))


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> Any:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>"])
    tok.train_from_iterator(["the sea is calm and the sky is wide"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")


def test_multi_byte_characters_split_across_tokens_stream_whole(qwen_tokenizer: Any) -> None:
    ids = qwen_tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # characters do split across tokens
    assert streamed(qwen_tokenizer, ids) == qwen_tokenizer.decode(ids) == TEXT


def test_random_answers_stream_a_prefix_of_their_decode(qwen_tokenizer: Any) -> None:
    rng = random.Random(7)
    vocab = len(qwen_tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        whole = qwen_tokenizer.decode(ids, skip_special_tokens=True)
        sent = streamed(qwen_tokenizer, ids)
        assert whole.startswith(sent), (ids, sent, whole)
        if not whole.endswith("\ufffd"):
            assert sent == whole, (ids, sent, whole)


def test_leading_spaces_of_sentencepiece_words_survive(metaspace_tokenizer: Any) -> None:
    text = "the sea is calm and the sky is wide"
    ids = metaspace_tokenizer.encode(text, add_special_tokens=False)
    whole = metaspace_tokenizer.decode(ids)
    assert " " in whole
    assert streamed(metaspace_tokenizer, ids) == whole


def test_a_step_decodes_a_window_not_the_whole_answer(qwen_tokenizer: Any) -> None:
    ids = qwen_tokenizer.encode(TEXT * 30, add_special_tokens=False)
    counting = CountingTokenizer(qwen_tokenizer)
    assert streamed(counting, ids) == TEXT * 30
    assert len(ids) > 500 and counting.longest <= 8
