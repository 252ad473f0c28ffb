"""Metric vocabulary, run store and sinks. Imports neither keel.trainer nor keel.chaos."""
