"""Reference pipelines in torch on CPU: tiny-omni (thinker → talker → code2wav), tiny-tts
(talker → code2wav) and tiny-image (ar → dit).

Weights are random but seeded from the pipeline and stage names, so every replica holds the same
model; each request runs on its own with a generator seeded from its seed, so a replay on any
replica gives the same bytes (DESIGN §3, invariant 3). One module per stage; ``layers`` holds the
shared building blocks, ``common`` the engine base class and input validation, ``processors`` the
stage-to-stage functions.
"""
