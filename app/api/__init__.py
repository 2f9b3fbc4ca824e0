"""The HTTP layer: the FastAPI app (`app.py`), its routes (OpenAI, SageMaker, probes, metrics), the
conversion between API bodies and engine requests (`serving.py`, `openai.py`, `tgi.py`, `streaming.py`),
startup (`startup.py`), and uvicorn with SIGTERM draining (`server.py`, `cli.py`: `inf2serve serve`)."""
