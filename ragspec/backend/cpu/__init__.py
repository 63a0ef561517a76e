"""The CPU backend: :class:`~ragspec.backend.cpu.target.CPUTarget`, the transformers target
with ragspec's CPU speed-ups."""
