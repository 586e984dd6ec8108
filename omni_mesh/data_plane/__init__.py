"""omni-mesh data plane: everything that moves request data between processes.

=================  ==========================================================================
``messages``       every struct that crosses a process boundary on the data path
``codec``          the one codec (msgpack via msgspec; zero-copy tensor bytes; JSON twins)
``tensors``        numpy arrays ⇄ wire tensors, with validation
``shm``            the shared-memory arena, reader, janitors, payload externalize/inline
``signing``        HMAC-SHA256 tags
``envelope``       the sealed, opaque ``/v1/run`` ``stage_input``
``framing``        the one length-prefixed frame format (encoder, incremental decoder)
``constants``      wire constants: content types, the inline-tensor bound
``channel``        the sidecar ⇄ engine control channel (``framing`` frames)
``connectors``     how a hop's tensors travel (shared-memory handles or inline bytes)
``wire``           bounded, fast HTTP body reading (the only module importing aiohttp)
``media``          WAV / PCM / PNG encodings of outputs for clients (pod and ``omni-run``)
=================  ==========================================================================

Nothing is imported here, so that engines can import the modules they need without pulling in
aiohttp.
"""
