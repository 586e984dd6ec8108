"""omni-mesh control plane."""
