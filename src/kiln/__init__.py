"""Kiln: GPU kernels (Triton, Pallas), performance tooling and a paged-KV inference engine."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # the engine's API loads lazily, so `import kiln` stays cheap for the kernel tooling
    if name in ("LLM", "SamplingParams", "StructuredOutputsParams"):
        import kiln.engine

        return getattr(kiln.engine, name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
