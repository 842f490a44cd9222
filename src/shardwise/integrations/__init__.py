"""Adapters for models from other libraries (Hugging Face ``transformers``)."""
