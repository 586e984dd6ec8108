"""``tiny-csm``: a random-weight CSM folder (backbone, depth decoder, Mimi codec) built from the
real config classes.

The whole architecture of ``sesame/csm-1b`` is there with shrunk sizes: a 2-layer Llama backbone
of width 64 that picks codebook 0 of each frame, a 2-layer depth decoder that picks the other 7
codebooks (8 codebooks of 64 codes, where the real model has 32 of 2048), and a Mimi codec with
its real layout (SEANet encoder and decoder with the real strides 8·6·5·4, so 1920 samples of
24 kHz audio per 12.5 Hz frame; encoder and decoder transformers with a short sliding window;
split residual quantizer) and 4-16 channels. A small Mimi must keep its ``upsample_groups`` (the
depthwise frame-rate upsampler) and ``codebook_dim`` equal to its ``hidden_size``.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the built-in corpus (the vLLM
tiny models'), with Llama 3's special tokens that CSM uses (``<|begin_of_text|>``,
``<|end_of_text|>``) and CSM's ``<|AUDIO|>`` / ``<|audio_eos|>``; the chat template renders each
turn as CSM's processor does, ``<|begin_of_text|>[speaker]text<|end_of_text|>`` (followed by the
audio placeholders for a context turn with audio). The feature extractor is Encodec's at 24 kHz,
as the real checkpoint's, so ``CsmProcessor.from_pretrained`` loads the folder.

Clear greedy choices: random weights give near-ties between logits, and a tie broken differently
by two kernels would make the fabric and the monolithic model part ways for no real reason. The
backbone's ``lm_head`` and the depth decoder's per-codebook heads are therefore drawn with a
large standard deviation (2.0). CSM ends an utterance on a frame of ``codebook_eos_token_id``
(code 0) in every codebook; the backbone's row for code 0 is zero, so codebook 0 practically
never picks it and an utterance lasts ``max_new_tokens`` frames (a random model has no sense of
when its sentence is spoken anyway), which makes lengths predictable for tests and benchmarks.
The generation config holds CSM's sampling defaults (temperature 0.9, top-k 50, for backbone and
depth decoder alike), so a plain ``generate()`` samples, as with the real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

SEED = 20261203
VERSION = 1

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>")
BPE_VOCAB = 480
TEXT_VOCAB = 512  # BPE + specials, rounded up (the rest are never-used ids)

CODEBOOK = 64  # codes per codebook (CSM vocab_size == Mimi codebook_size)
CODEBOOKS = 8  # codebooks per frame (CSM num_codebooks == Mimi num_quantizers)
EOS_CODE = 0  # CSM's codebook_eos_token_id: a frame of it in every codebook ends the utterance
SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 50}

HEAD_STD = 2.0
WAVE_SCALE = 0.03

#: CSM's template: one ``[speaker]text`` turn per message, audio placeholders for context audio.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ bos_token }}[{{ message['role'] }}]{{ message['content'][0]['text'] }}{{ eos_token }}"
    "{%- if message['content'] | length > 1 -%}<|AUDIO|><|audio_eos|>{%- endif -%}"
    "{%- endfor -%}"
)


def write_tiny_model(folder: Path) -> None:
    """Write config, weights, generation config, tokenizer and processor of tiny-csm."""
    import torch
    from transformers import CsmForConditionalGeneration

    ids = _write_tokenizer(folder)
    config = _config(ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = CsmForConditionalGeneration(config).eval()
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, HEAD_STD)
            model.lm_head.weight[EOS_CODE].zero_()  # codebook 0 never ends the utterance
            model.depth_decoder.codebooks_head.weight.normal_(0.0, HEAD_STD)
            # Mimi's codebooks start as zeros (``embed_sum``, a buffer transformers zero-fills):
            # every code would decode to the same silence. Draw them.
            for name, buffer in model.codec_model.named_buffers():
                if name.endswith("codebook.embed_sum"):
                    buffer.normal_(0.0, 1.0)
            last = model.codec_model.decoder.layers[-1].conv  # waveform within about ±0.5
            last.weight.mul_(WAVE_SCALE)
            last.bias.zero_()
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    bad += [n for n, b in model.named_buffers() if b.is_floating_point() and not b.isfinite().all()]
    if bad:
        raise RuntimeError(f"tiny-csm: non-finite initial weights in {bad[:3]}")
    for generation in (model.generation_config, model.depth_decoder.generation_config):
        generation.update(**SAMPLING)
        # a config "from the model config" is loaded without its extra keys: the depth
        # decoder's ``depth_decoder_*`` sampling would be dropped on load
        generation._from_model_config = False
    model.save_pretrained(folder, safe_serialization=True)
    _write_processor(folder)
    (folder / "omni_tiny.json").write_text(json.dumps({"version": VERSION, "seed": SEED}))


def _write_tokenizer(folder: Path) -> dict[str, int]:
    from transformers import PreTrainedTokenizerFast

    from omni_mesh.engines.hf.tokenizer import train_byte_bpe

    tok = train_byte_bpe(BPE_VOCAB, SPECIAL_TOKENS, TEXT_VOCAB)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|AUDIO|>",  # as csm-1b: pad and audio share an id
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"audio_token": "<|AUDIO|>", "audio_eos_token": "<|audio_eos|>"},
    )
    fast.save_pretrained(folder)
    vocab = tok.get_vocab()
    return {name: vocab[name] for name in SPECIAL_TOKENS}


def _write_processor(folder: Path) -> None:
    from transformers import AutoTokenizer, CsmProcessor, EncodecFeatureExtractor

    features = EncodecFeatureExtractor(feature_size=1, sampling_rate=24000)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    CsmProcessor(features, tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(folder)


def _config(ids: dict[str, int]) -> object:
    from transformers import CsmConfig, MimiConfig

    hidden = 64
    depth_decoder = {
        "num_codebooks": CODEBOOKS,
        "backbone_hidden_size": hidden,
        "vocab_size": CODEBOOK,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": CODEBOOKS + 1,
    }
    mimi_hidden = 32
    codec = MimiConfig(
        sampling_rate=24000,
        hidden_size=mimi_hidden,
        num_filters=4,
        num_residual_layers=1,
        upsampling_ratios=[8, 6, 5, 4],
        codebook_size=CODEBOOK,
        codebook_dim=mimi_hidden,
        vector_quantization_hidden_dimension=mimi_hidden,
        num_quantizers=CODEBOOKS,
        num_semantic_quantizers=1,
        upsample_groups=mimi_hidden,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        sliding_window=8,
        layer_scale_initial_scale=1.0,
        max_position_embeddings=8000,
        use_cache=False,
    )
    return CsmConfig(
        num_codebooks=CODEBOOKS,
        vocab_size=CODEBOOK,
        text_vocab_size=TEXT_VOCAB,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=ids["<|begin_of_text|>"],
        pad_token_id=ids["<|AUDIO|>"],
        audio_token_id=ids["<|AUDIO|>"],
        audio_eos_token_id=ids["<|audio_eos|>"],
        codebook_eos_token_id=EOS_CODE,
        codebook_pad_token_id=CODEBOOK - 1,
        depth_decoder_config=depth_decoder,
        codec_config=codec,
        torch_dtype="float32",
    )
