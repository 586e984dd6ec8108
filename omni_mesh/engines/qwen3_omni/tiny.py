"""``tiny-qwen3-omni``: a random-weight Qwen3-Omni-MoE folder built from the real config classes.

Every part of the real architecture is there (audio encoder, vision encoder, MoE thinker, MoE
talker with its code predictor, causal Code2Wav) with shrunk sizes: a few layers of width 32-64,
4 experts, 4 codebooks of 64 codes. The tokenizer is a byte-level BPE trained with ``tokenizers``
on the built-in corpus (the vLLM tiny models'), with Qwen's special tokens and chat template, and
the feature extractor is Whisper's (128 mel bins, as the real model). Special ids are small (the
real ones need a 152k vocabulary): they are config fields, and every stage reads them from the
config, as for a real checkpoint.

Clear greedy choices: random weights give near-ties between logits, and a tie broken differently
by two kernels (a batch of 1 against a batch of 4) would make the fabric and the monolithic model
part ways for no real reason. The output heads (thinker ``lm_head``, talker ``codec_head``, the
code predictor's heads) are therefore drawn with a large standard deviation (2.0), so the top
logit of a step is typically several units above the next one, far beyond float32 noise. The
talker's ``codec_eos`` row is zero, so it never outscores the codes: an utterance lasts the
talker's ``max_frames`` (a random model has no sense of when its answer is spoken anyway), which
makes lengths predictable for tests and benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path

SEED = 20261202
VERSION = 2  # 2: loadable by vLLM's thinker too (head_dim 32, full processor, issue 33)

#: Special tokens, in id order after the BPE vocabulary (Qwen's names).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
)
#: Role words, each one token (as in Qwen's vocabulary, where ``user`` is id 872).
ROLE_TOKENS = ("system", "user", "assistant")
BPE_VOCAB = 480
TEXT_VOCAB = 512  # BPE + specials + roles, rounded up (the rest are never-sampled ids)

CODEBOOK = 64  # codes per codebook (code2wav codebook_size, code predictor vocabulary)
CODE_GROUPS = 4  # codebooks per frame (talker num_code_groups == code2wav num_quantizers)
TALKER_VOCAB = CODEBOOK + 1024  # the top 1024 ids are codec specials, suppressed but codec_eos
CODEC_IDS = {
    "codec_pad_id": CODEBOOK,
    "codec_bos_id": CODEBOOK + 1,
    "codec_eos_token_id": CODEBOOK + 2,
    "codec_nothink_id": CODEBOOK + 3,
    "codec_think_bos_id": CODEBOOK + 4,
    "codec_think_eos_id": CODEBOOK + 5,
}
SPEAKERS = {"ethan": CODEBOOK + 10, "chelsie": CODEBOOK + 11, "aiden": CODEBOOK + 12}

HEAD_STD = 2.0
INIT_STD = 0.02

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_model(folder: Path) -> None:
    """Write config, weights, tokenizer and feature extractor of tiny-qwen3-omni into folder."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    ids = _write_tokenizer(folder)
    config = _config(ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
        with torch.no_grad():
            # transformers leaves the fused MoE expert tensors (``experts.gate_up_proj``,
            # ``experts.down_proj``) uninitialised (torch.empty): draw them here.
            for name, param in model.named_parameters():
                if ".experts." in name:
                    param.normal_(0.0, INIT_STD)
            model.thinker.lm_head.weight.normal_(0.0, HEAD_STD)
            model.talker.codec_head.weight.normal_(0.0, HEAD_STD)
            # codec_eos never wins against the random codes: an answer lasts max_frames frames
            model.talker.codec_head.weight[CODEC_IDS["codec_eos_token_id"]].zero_()
            for head in model.talker.code_predictor.lm_head:
                head.weight.normal_(0.0, HEAD_STD)
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise RuntimeError(f"tiny-qwen3-omni: non-finite initial weights in {bad[:3]}")
    model.save_pretrained(folder, safe_serialization=True)
    _write_processor(folder)
    (folder / "omni_tiny.json").write_text(json.dumps({"version": VERSION, "seed": SEED}))


def _write_tokenizer(folder: Path) -> dict[str, int]:
    from transformers import PreTrainedTokenizerFast

    from omni_mesh.engines.hf.tokenizer import train_byte_bpe

    tok = train_byte_bpe(BPE_VOCAB, SPECIAL_TOKENS, TEXT_VOCAB, ROLE_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens={
            "audio_token": "<|audio_pad|>",
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
    )
    fast.save_pretrained(folder)
    vocab = tok.get_vocab()
    return {name: vocab[name] for name in (*SPECIAL_TOKENS, *ROLE_TOKENS)}


def _write_processor(folder: Path) -> None:
    """The whole multimodal processor (Whisper features, Qwen2-VL image and video processors,
    the tokenizer): vLLM's thinker reads audio through it (a feature extractor alone is
    refused)."""
    from transformers import (
        AutoTokenizer,
        Qwen2VLImageProcessor,
        Qwen3OmniMoeProcessor,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    processor = Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(),
        video_processor=Qwen2VLVideoProcessor(),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)


def _config(ids: dict[str, int]) -> object:
    from transformers import Qwen3OmniMoeConfig

    hidden = 64
    thinker_text = {
        "vocab_size": TEXT_VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # vLLM's CPU attention: head_dim in {32, 64, 80, ...}
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [8, 4, 4],  # sums to head_dim / 2
            "interleaved": True,  # transformers' name
            "mrope_interleaved": True,  # vLLM's (read as false without it)
        },
        "tie_word_embeddings": False,  # vLLM reads it from the text config
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    audio = {
        "num_mel_bins": 128,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": hidden,
        "downsample_hidden_size": 16,
        "max_source_positions": 1500,
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": hidden,
        "deepstack_visual_indexes": [0],
        "num_position_embeddings": 64,
        "patch_size": 16,
        "image_size": 128,  # patch_size x sqrt(num_position_embeddings): vLLM reads it
        "apply_vit_abs_pos_embed": True,
    }
    multimodal = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "audio_end_token_id": ids["<|audio_end|>"],
        "position_id_per_seconds": 25,
    }
    thinker = {
        "text_config": thinker_text,
        "audio_config": audio,
        "vision_config": vision,
        "user_token_id": ids["user"],
        "vision_start_token_id": ids["<|vision_start|>"],
        **multimodal,
    }
    talker_text = {
        "vocab_size": TALKER_VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [4, 2, 2],
            "interleaved": True,
        },
    }
    code_predictor = {
        "vocab_size": CODEBOOK,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_code_groups": CODE_GROUPS,
        "max_position_embeddings": 64,
    }
    talker = {
        "text_config": talker_text,
        "code_predictor_config": code_predictor,
        "num_code_groups": CODE_GROUPS,
        "thinker_hidden_size": hidden,
        "accept_hidden_layer": 1,
        "speaker_id": SPEAKERS,
        "spatial_merge_size": 2,
        "vision_start_token_id": ids["<|vision_start|>"],
        **CODEC_IDS,
        **multimodal,
    }
    code2wav = {
        "codebook_size": CODEBOOK,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_quantizers": CODE_GROUPS,
        "sliding_window": 8,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 32,
        "max_position_embeddings": 8000,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<|tts_pad|>"],
        tts_bos_token_id=ids["<|tts_bos|>"],
        tts_eos_token_id=ids["<|tts_eos|>"],
        system_token_id=ids["system"],
        user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
        torch_dtype="float32",
    )
