"""The offline compile step: a Hugging Face Llama checkpoint becomes a validated, content-addressed
artifact (see ../shared/DESIGN.md, "The artifact"), published to a directory or S3. `compile/` imports
`app/`; `app/` never imports `compile/`."""
