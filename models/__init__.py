"""Model definitions and checkpoint loading (Hugging Face format)."""
