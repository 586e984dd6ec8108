"""The tiny folders' tokenizer: a byte-level BPE trained offline on the repository's corpus.

Every machine trains the same merges (a fixed corpus, ``tokenizers``' deterministic trainer);
the model's special tokens follow the merges, then words that must be one token each (Qwen's
role names).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

#: The corpus's pseudo-words are drawn from this seed: every machine trains the same merges.
CORPUS_SEED = 20261201

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. a serving fabric moves tensors between "
    "stages; the thinker writes text, the talker speaks codes, and code2wav turns them into "
    "sound. hello world! how are you today? tell me a story about a small robot who learned "
    "to sing. numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ' \" ( ) - + = / "
)


def training_corpus() -> list[str]:
    """The fixed text plus seeded pseudo-words: enough distinct pairs for every BPE merge."""
    rng = random.Random(CORPUS_SEED)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = [
        "".join(rng.choice(letters[: rng.randint(6, 26)]) for _ in range(rng.randint(2, 9)))
        for _ in range(20_000)
    ]
    return [_CORPUS] * 4 + [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]


def train_byte_bpe(
    merges_vocab: int, special: Sequence[str], limit: int, words: Sequence[str] = ()
) -> Any:
    """A ``tokenizers.Tokenizer`` with ``merges_vocab`` BPE ids, then ``special`` (special
    tokens) and ``words`` (ordinary added tokens); RuntimeError past ``limit`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=merges_vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_special_tokens(list(special))
    if words:
        tok.add_tokens(list(words))
    if tok.get_vocab_size() > limit:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} ids, over {limit}")
    return tok
