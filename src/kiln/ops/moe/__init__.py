"""moe ops (see docs/contracts.md)."""

__all__: list[str] = []
