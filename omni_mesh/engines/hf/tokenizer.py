"""The tiny folders' tokenizer: a byte-level BPE trained offline on the repository's corpus.

Every machine trains the same merges (a fixed corpus, ``tokenizers``' deterministic trainer);
the model's special tokens follow the merges, then words that must be one token each (Qwen's
role names).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def train_byte_bpe(
    merges_vocab: int, special: Sequence[str], limit: int, words: Sequence[str] = ()
) -> Any:
    """A ``tokenizers.Tokenizer`` with ``merges_vocab`` BPE ids, then ``special`` (special
    tokens) and ``words`` (ordinary added tokens); RuntimeError past ``limit`` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from omni_mesh.engines.vllm.tiny_models import training_corpus

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
