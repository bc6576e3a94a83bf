"""Adapters that put moe_engine behind other libraries' own extension points (transformers.py: Hugging Face
transformers' experts dispatch). Each imports its library only when imported itself."""
