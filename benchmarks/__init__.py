"""Benchmarks: every figure is a ratio against a baseline measured in the same run.

Not part of the serving engine: ``dspine.replica`` and the serving modules of ``dspine.cluster``
never import this package (tests/test_packaging.py); the CLI's ``dspine bench`` commands do.

``engine``                 ``dspine bench engine``: target-only vs speculative, speedup, acceptance, stages
``sweep``                  ``--sweep``: every sampling / concurrency regime on one engine
``sweep_server``           ``--sweep --through-server``: the same regimes through the standalone server
``kv_layouts``             ``--kv-layouts``: contiguous vs paged target K/V
``tracing_overhead``       ``--tracing``: request tracing on vs off
``plot``                   ``--plot``: the histogram and stage breakdown as a PNG (matplotlib extra)
``transformers_baseline``  ``dspine bench target``: this engine vs transformers ``generate`` (dev-only)
``prefill``                ``dspine bench prefill``: peak memory of a long prefill, chunked vs unchunked
``cluster``                ``dspine bench cluster``: the serving path vs the engine (``load``, ``servers``)
``acceptance``             ``python -m dspine.benchmarks.acceptance``: Gumbel vs rejection sampling acceptance
``prompts``                held-out stdlib prompts (or seeded random ids) shared by the benches
``refusal_latency``        ``python -m dspine.benchmarks.refusal_latency``: RESOURCE_EXHAUSTED latency, 200 streams on 8 slots
``engine_refusal_latency`` ``python -m dspine.benchmarks.engine_refusal_latency``: the engine's refusals while it steps
``ragged_step``            ``python -m dspine.benchmarks.ragged_step``: a ragged target forward, packed vs padded rows
"""
