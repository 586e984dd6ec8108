"""``tiny-glm-image``: a random-weight GLM-Image folder built offline from the real config classes.

The folder is laid out as the real checkpoint (``zai-org/GLM-Image``) is, one subfolder per
component of diffusers' ``GlmImagePipeline`` plus its ``model_index.json``, so
``GlmImagePipeline.from_pretrained(folder)`` loads it and each stage loads only its own parts:

- ``vision_language_encoder/``: transformers' ``GlmImageForConditionalGeneration`` (2-layer text
  model of width 32 with GLM's 3D rope, a 1-block vision encoder, the VQ tokenizer) and its
  generation config (sampling: temperature, top-k, top-p, the end-of-image id as EOS);
- ``processor/``: ``GlmImageProcessor`` (chat template, grid tokens; its image processor with the
  vision encoder's 16-pixel patches) and the tokenizer;
- ``transformer/``: diffusers' ``GlmImageTransformer2DModel`` (2 blocks, width 32);
- ``vae/``: ``AutoencoderKL`` with four blocks (a scale factor of 8, as the real one) and 4 latent
  channels, with per-channel ``latents_mean`` / ``latents_std``;
- ``text_encoder/`` + ``tokenizer/``: the glyph encoder, a 2-layer ``T5EncoderModel`` read through
  ``ByT5Tokenizer`` (bytes: no vocabulary file);
- ``scheduler/``: ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting (the pipeline's ``mu``).

Token ids. The tokenizer is a byte-level BPE trained with ``tokenizers`` on the built-in corpus,
followed by GLM's special tokens (``[gMASK]``, ``<sop>``/``<eop>`` that also frame the grid sizes,
role tokens, ``<|image|>``, ``<|begin_of_image|>``/``<|end_of_image|>``). The AR's head writes
ids of its vision vocabulary only, the first ``CODEBOOK`` ids (the real model's VQ codebook is its
first 16,384 ids): these are the DiT's prior token ids. The end-of-image id lies past the head,
so a random model never ends early: a text-to-image request decodes exactly the preview grid,
the target grid and one more token, as the pipeline's ``max_new_tokens`` says, and lengths are
predictable for tests and benchmarks. (The tiny text ids share the embedding's low rows with the
codebook; the real vocabulary keeps them apart. Only token embeddings are shared, never an id
the model reads as a marker.)

Deterministic: every weight is drawn from ``SEED`` (the process RNG forked, so the caller's is
untouched). The random VAE's pixels spread over [0, 255] (all 256 values, a few percent clipped
at the ends), so an image's equality is a real test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEED = 20261208
VERSION = 1

CODEBOOK = 128  # VQ codes: the AR head's vision vocabulary and the DiT's prior embedding
BPE_VOCAB = 480
TEXT_VOCAB = 512  # BPE + specials, rounded up (the rest are never-used ids)

#: GLM's special tokens, in id order after the BPE vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|image|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
)

#: The AR's sampling, as its generation config says (``generate(do_sample=True)`` reads it).
SAMPLING = {"temperature": 0.9, "top_k": 48, "top_p": 0.95}

#: GLM's chat template: ``[gMASK]<sop>`` then one ``<|role|>`` turn per message; an image part
#: is ``<|begin_of_image|><|image|><|end_of_image|>`` (the processor expands ``<|image|>``).
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

LATENT_CHANNELS = 4


def write_tiny_model(folder: Path) -> None:
    """Write every component of tiny-glm-image and its ``model_index.json`` into ``folder``."""
    import torch
    from diffusers import GlmImagePipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        processor, ids = _processor()
        pipeline = GlmImagePipeline(
            tokenizer=_glyph_tokenizer(),
            processor=processor,
            text_encoder=_glyph_encoder(),
            vision_language_encoder=_ar_model(ids),
            vae=_vae(),
            transformer=_dit(),
            scheduler=_scheduler(),
        )
    bad = [
        name
        for part in ("vision_language_encoder", "text_encoder", "vae", "transformer")
        for name, param in getattr(pipeline, part).named_parameters()
        if not bool(torch.isfinite(param).all())
    ]
    if bad:
        raise RuntimeError(f"tiny-glm-image: non-finite initial weights in {bad[:3]}")
    pipeline.save_pretrained(folder, safe_serialization=True)
    _name_transformers_library(folder / "model_index.json")
    (folder / "omni_tiny.json").write_text(json.dumps({"version": VERSION, "seed": SEED}))


def _name_transformers_library(index: Path) -> None:
    """diffusers records the AR model and its processor under their module's name
    (``glm_image``); the real checkpoint's index names their library, ``transformers``."""
    parts = json.loads(index.read_text())
    for name in ("processor", "vision_language_encoder"):
        parts[name][0] = "transformers"
    index.write_text(json.dumps(parts, indent=2, sort_keys=True) + "\n")


def _processor() -> tuple[Any, dict[str, int]]:
    from transformers import GlmImageImageProcessorPil, GlmImageProcessor, PreTrainedTokenizerFast

    from omni_mesh.engines.hf.tokenizer import train_byte_bpe

    tok = train_byte_bpe(BPE_VOCAB, SPECIAL_TOKENS, TEXT_VOCAB)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_image|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens={
            "image_token": "<|image|>",
            "grid_bos_token": "<sop>",
            "grid_eos_token": "<eop>",
        },
    )
    images = GlmImageImageProcessorPil(patch_size=16, temporal_patch_size=1, merge_size=1)
    processor = GlmImageProcessor(
        image_processor=images, tokenizer=fast, chat_template=CHAT_TEMPLATE
    )
    vocab = tok.get_vocab()
    return processor, {name: vocab[name] for name in SPECIAL_TOKENS}


def _ar_model(ids: dict[str, int]) -> Any:
    from transformers import GenerationConfig, GlmImageConfig, GlmImageForConditionalGeneration

    text = {
        "vocab_size": TEXT_VOCAB,
        "vision_vocab_size": CODEBOOK,  # the head's ids: the codebook alone (module docstring)
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,  # as the real model: rope on half of each head
            "mrope_section": [2, 1, 1],  # temporal, height, width; sums to head_dim * 0.5 / 2
        },
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|end_of_image|>"],
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "image_size": 256,
        "patch_size": 16,
        "spatial_merge_size": 1,
    }
    vq = {"embed_dim": 16, "num_embeddings": CODEBOOK, "latent_channels": 32}
    config = GlmImageConfig(
        text_config=text,
        vision_config=vision,
        vq_config=vq,
        image_token_id=ids["<|image|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        dtype="float32",
    )
    model = GlmImageForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        do_sample=True,
        eos_token_id=ids["<|end_of_image|>"],
        pad_token_id=ids["<|endoftext|>"],
        **SAMPLING,
    )
    return model


def _glyph_tokenizer() -> Any:
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def _glyph_encoder() -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=384,  # ByT5: 3 specials + 256 bytes + 125 extra ids
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        dtype="float32",
    )
    return T5EncoderModel(config).eval()


def _dit() -> Any:
    from diffusers import GlmImageTransformer2DModel

    return GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        text_embed_dim=32,  # the glyph encoder's d_model
        time_embed_dim=32,
        condition_dim=16,
        prior_vq_quantizer_codebook_size=CODEBOOK,
    ).eval()


def _vae() -> Any:
    import torch
    from diffusers import AutoencoderKL

    generator = torch.Generator().manual_seed(SEED + 1)
    mean = (torch.randn(LATENT_CHANNELS, generator=generator) * 0.1).tolist()
    std = (0.5 + torch.rand(LATENT_CHANNELS, generator=generator)).tolist()
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),  # four blocks: scale factor 2**3 = 8, as the real VAE
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=64,
        latents_mean=mean,
        latents_std=std,
    ).eval()


def _scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        base_shift=0.25,
        max_shift=0.75,
        time_shift_type="linear",
    )
