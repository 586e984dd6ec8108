"""The outbound hop: a stage input sent to a replica of another stage, and its answer read
back. The client and its replays (``client``), the pooled HTTP connections (``http``,
``conn``), reading answers and sheds (``answers``, ``shed``), picking a replica (``router``),
ejecting silent ones (``liveness``), the hop's time limits (``timeouts``) and waking a stage
scaled to zero (``waker``). Imports nothing else of the pod."""
