"""omni-mesh sidecar."""
