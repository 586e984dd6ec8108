"""The control plane's state in Redis: the key schema (``keys``), instances and pools
(``instances``), autoscaling (``scale``) and realtime sessions (``sessions``), each write atomic
(Lua ``scripts``, MULTI)."""
