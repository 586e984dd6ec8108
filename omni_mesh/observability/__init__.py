"""omni-mesh observability."""
