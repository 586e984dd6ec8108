"""The batched decode every autoregressive ``transformers`` stage shares: running requests are
rows of one batch (:mod:`.frame_batch`) over a left-padded cache (:mod:`.padded_cache`), stepped
together by :mod:`.frame_engine`, each row sampled from its own generator (:mod:`.row_sampling`)
and streamed in chunks (:mod:`.frame_stream`); :mod:`.kv_split` is a split stage's side of it
(a prefill replica holds a row's state, a decode replica pulls it, through :mod:`..kv`).
"""
