"""Artifacts: the manifest schema, storage (local directories and S3), the golden reference records and
the loader that turns an artifact URI or alias into a verified local directory at server startup."""
