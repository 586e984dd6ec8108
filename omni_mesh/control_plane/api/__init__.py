"""omni-cp's HTTP API (DESIGN §6): the instance routes, discovery and its watch, the stage scale
resource, realtime sessions, the middlewares and the parsing of untrusted input."""
