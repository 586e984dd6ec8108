"""Real model architectures from ``transformers``, one stage per submodule of one model folder.

``qwen3_omni_*``: Qwen3-Omni-MoE (thinker → talker with code predictor → causal code2wav);
``csm_*``: CSM (backbone + depth decoder → Mimi decoder). :mod:`.folders` resolves a stage's
``model`` (a tiny registered name, built offline on first use, or a Hugging Face folder).
"""
