"""mixprec: measure what mixed precision buys on your GPU, through one Hydra-configured loop."""

__version__ = "0.1.0"
