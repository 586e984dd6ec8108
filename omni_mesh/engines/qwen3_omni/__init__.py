"""Qwen3-Omni-MoE on ``transformers``, one stage per part of one model folder: the thinker (text
and audio in → text, embeddings and hidden states; :mod:`.thinker`, batched by
:mod:`.thinker_batch`, its prompts from :mod:`.inputs`), the talker with its code predictor
(:mod:`.talker`, :mod:`.talker_batch`, :mod:`.talker_prompt`), the causal code2wav
(:mod:`.code2wav`); :mod:`.processors` hands each stage's output to the next, :mod:`.tiny` builds
``tiny-qwen3-omni`` offline from the real config classes.
"""
