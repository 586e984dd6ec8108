"""omni-mesh engines."""
