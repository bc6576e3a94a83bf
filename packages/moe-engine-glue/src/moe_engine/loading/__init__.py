"""Loading whole models from shipped checkpoints (from_pretrained): sources (GGUF, safetensors), the meta-device
skeleton and its non-expert weights, the GPU budget. The routed experts stream from the file into banks."""
