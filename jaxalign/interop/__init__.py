"""Interop with other stacks: Hugging Face checkpoints and golden files for porting."""
