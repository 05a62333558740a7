"""Several jobs on one cluster's fabric: where each runs, how they run together, and
how much each slows the others (``clustersim colocate``)."""
