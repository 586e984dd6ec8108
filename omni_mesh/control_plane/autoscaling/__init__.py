"""Per-stage autoscaling: the pure policy (``policy``) and the loop the sweeper-lock holder runs
around it (``autoscaler``)."""
