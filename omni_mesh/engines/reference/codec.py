"""The codec frames the talker produces and code2wav decodes: their layout and timing.

A frame is 4 codes (one per codebook of 1024) for 1920 samples of 24 kHz audio (12.5 Hz).
``CONTEXT_FRAMES`` is the left receptive field of code2wav's causal decoder in frames: a chunk of
frames decoded after that many frames of the codes before it gives the same samples as decoding
the whole sequence (so the talker sends that many frames of ``context_codes`` with each chunk).
"""

from __future__ import annotations

NUM_CODEBOOKS = 4
CODEBOOK_SIZE = 1024
SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1920
#: 2 residual blocks x 2 causal k=3 convs at the frame rate (8 frames) + the causal k=7 post conv
#: at the sample rate, whose 6 samples of history reach into the frame before (1 frame).
CONTEXT_FRAMES = 9
