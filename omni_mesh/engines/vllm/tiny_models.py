"""Tiny Llama models for the vLLM pipelines, built offline and deterministically.

No hub, no network: a model named here (``tiny-llama-text``, ``tiny-llama-codec``) is written
the first time it is needed into ``<cache>/<name>-v<VERSION>`` — a Hugging Face model folder
(``config.json``, ``model.safetensors``, tokenizer files) that vLLM loads like any other. The
weights are random from a fixed seed and the tokenizer is a byte-level BPE trained with
``tokenizers`` on a built-in corpus, so every machine builds the same files.

* ``tiny-llama-text`` (the thinker): hidden 64, 2 layers, 2 heads of 32 (vLLM's CPU attention
  needs head_dim in {32, 64, …}), 1 KV head, vocabulary 1024 with a chat template.
* ``tiny-llama-codec`` (the talker): the same shape; its vocabulary *is* the codec: token id
  ``t`` < 1024 is code ``t`` (4 consecutive ids make one frame of 4 codebooks). No tokenizer:
  its engine runs with ``skip_tokenizer_init`` and speaks token ids only.

:func:`resolve_model` maps a stage's ``model`` to a folder: a tiny name is built (once, several
processes of a machine waiting for the first), anything else must be an existing folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omni_mesh.engines.hf.tokenizer import training_corpus
from omni_mesh.engines.model_cache import build_once, default_cache_dir, existing_folder

VERSION = 1
SEED = 20261201
CODEC_VOCAB = 1024  # = reference codec CODEBOOK_SIZE: talker token id t is code t
TEXT_VOCAB = 1024

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


class TinyModelError(ValueError):
    """A ``model`` that is neither a tiny model name nor an existing folder."""


@dataclass(frozen=True)
class TinySpec:
    """Shape of one tiny model."""

    vocab_size: int
    with_tokenizer: bool
    hidden_size: int = 64
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    intermediate_size: int = 128
    max_positions: int = 2048


TINY_MODELS: dict[str, TinySpec] = {
    "tiny-llama-text": TinySpec(vocab_size=TEXT_VOCAB, with_tokenizer=True),
    "tiny-llama-codec": TinySpec(vocab_size=CODEC_VOCAB, with_tokenizer=False),
}


def resolve_model(model: str, cache_dir: Path | None = None) -> Path:
    """The folder vLLM should load for ``model`` (see the module docstring)."""
    if model in TINY_MODELS:
        return ensure_tiny_model(model, cache_dir or default_cache_dir())
    return existing_folder(model, TINY_MODELS, TinyModelError)


def ensure_tiny_model(name: str, cache_dir: Path) -> Path:
    """Build tiny model ``name`` into ``cache_dir`` unless it is there already; its folder."""
    spec = TINY_MODELS[name]
    return build_once(cache_dir / f"{name}-v{VERSION}", lambda folder: _write_model(spec, folder))


def _write_model(spec: TinySpec, folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    special: dict[str, int | None] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if not spec.with_tokenizer:  # codes only: no special ids inside the codec range
        special = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **special,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + spec.vocab_size)
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # larger logits than the default init: varied, seed-driven text
            model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    if spec.with_tokenizer:
        _write_tokenizer(spec.vocab_size, folder)
    (folder / "omni_tiny.json").write_text(json.dumps({"version": VERSION, "seed": SEED}))


def _write_tokenizer(vocab_size: int, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:  # every id the model can sample must decode
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} ids, not {vocab_size}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(folder)
