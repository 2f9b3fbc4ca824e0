"""Structured output and tool calls: grammars (llguidance) compiled from a request's constraint, and the
tool-call formats of the model families served (rendering through the chat template, parsing the output)."""
