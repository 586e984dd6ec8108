"""The stage pod: the sidecar process (aiohttp) in front of one engine process (`omni-stage`)."""
