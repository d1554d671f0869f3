"""torch.compile of the whole model or of each repeated block, and CUDA graphs (compiling.py).
The inductor patches it may install live in internals/.

May import: core, models, internals.
"""
