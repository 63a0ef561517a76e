"""The CUDA backend: every request's draft tree verified in one forward per engine step.

Placeholder: the entry point is added with the target (see the module list below).
"""
