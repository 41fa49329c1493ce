"""Model definitions: the Qwen3.5-family target and the DSpine drafter."""
