"""`kiln serve`: an OpenAI-compatible HTTP server over the paged-KV engine (FastAPI + uvicorn)."""
