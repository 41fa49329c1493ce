"""Training recipes for the embedded default pair (CPU-friendly, seeded).

Not part of the serving engine: ``dspine.replica`` never imports this package (tests/test_packaging.py).

``corpus``      the Python standard library's .py sources, split train / held-out by file
``tokenizer``   a byte-level BPE tokenizer saved as tokenizer.json, like Qwen's
``target``      the tiny Qwen3.5-style hybrid target, trained from scratch
``draft``       the DSpine drafter, distilled from the frozen target
"""
