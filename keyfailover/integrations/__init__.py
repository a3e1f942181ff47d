"""Integrations: Prometheus metrics, Spark, export of the log and ownership plots.

They read the core and the broker; nothing inside imports them.
"""
