"""omni-mesh configs."""
