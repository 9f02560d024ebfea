"""Observers of the engine's events (core/events.py): Stats counters, Prometheus metrics and
traces. The step loop counts nothing itself."""
