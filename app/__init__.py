"""inf2serve's serving runtime: settings, artifacts, backends, engine, HTTP API and metrics."""

__version__ = "0.1.0"
