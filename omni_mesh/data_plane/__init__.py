"""omni-mesh data plane."""
