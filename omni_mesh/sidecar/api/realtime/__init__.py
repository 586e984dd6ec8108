"""Realtime sessions: the OpenAI Realtime GA protocol over a WebSocket on API servers."""
