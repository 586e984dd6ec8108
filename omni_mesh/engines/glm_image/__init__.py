"""GLM-Image (zai-org) served stage by stage: the AR generator (transformers'
``GlmImageForConditionalGeneration``) writes prior token ids, the DiT stage (diffusers'
``GlmImageTransformer2DModel`` with its T5 glyph encoder, FlowMatch-Euler and ``AutoencoderKL``)
turns them into the image, as diffusers' ``GlmImagePipeline`` does in one process. Each stage
loads only its own parts of one folder laid out as the real checkpoint (``tiny.py`` builds a
tiny random-weight one offline).
"""
