"""Reference pipelines in torch on CPU: tiny-omni (thinker → talker → code2wav), tiny-tts
(talker → code2wav) and tiny-image (ar → dit): the fabric's fixtures.

Weights are random but seeded from the pipeline and stage names, so every replica holds the same
model; each request runs on its own with a generator seeded from its seed, so a replay on any
replica gives the same bytes (DESIGN §3, invariant 3). One module per stage, each a
:class:`~omni_mesh.engines.torch_engine.TorchEngine`; ``layers`` holds the shared building
blocks, ``common`` the voices and default sampling, ``processors`` the stage-to-stage functions.
"""
