"""grpo package."""
