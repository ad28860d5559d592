"""Other stacks: `hf` (transformers checkpoints and bf16 emulation policies), `golden` (the porting kit)."""

from jaxalign.interop import golden, hf

__all__ = ["golden", "hf"]
