"""The link to this pod's engine process: its client over shared memory (``client``) and the
outputs of one stage input inside the stage's trace span (``outputs``). Imports nothing else
of the pod."""
