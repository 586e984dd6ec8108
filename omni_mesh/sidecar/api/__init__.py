"""The pod's client-facing routes: OpenAI-compatible HTTP, ``/v1/run`` and realtime sessions."""
