"""Reusable test helpers: toy executors, Hypothesis strategies and state machines for the pure core.

Import what you need from the submodules; this package imports no torch unless you import a torch helper.
"""
