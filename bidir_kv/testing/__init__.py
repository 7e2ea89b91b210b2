"""The pytest plugin and helpers shared by every suite (loaded from the root conftest)."""
