"""Prometheus: the exposition of a `stats` reply, its HTTP endpoint and that endpoint's
limits, and the latency histograms the ops observe."""
