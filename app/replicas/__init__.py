"""Replicas: one server process (HTTP, tokenizer, router) driving N engine processes, each with its own
backend on its own device placement (a contiguous NeuronCore group on inf2).

`worker.py` is a replica process: an `LLMEngine` on its backend, fed and drained over one pipe.
`pool.py` is the front's side: it starts, routes to, restarts and stops the replicas, and is the
`EngineClient` the HTTP layer talks to. `router.py` picks the replica by outstanding work.
"""
