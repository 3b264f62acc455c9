"""The core wing: the checkpoint primitive and its region, measuring a step and tracking
its memory, capturing and restoring state, the training step, the time model, conflicts
with other checkpointing, and Hugging Face specifics. It imports nothing above it."""
