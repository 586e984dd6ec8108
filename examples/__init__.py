"""Examples of using omni-mesh from outside the package (see each folder's README)."""
