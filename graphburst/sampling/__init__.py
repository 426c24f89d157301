"""Sampling mode: per-request settings (``params``) and the burst's sampling rounds (``mode``).

The sampling kernels and their numpy twins live in :mod:`graphburst.kernels`.
"""
