"""A user's own two-stage pipeline ("echo"): see README.md in this folder."""
