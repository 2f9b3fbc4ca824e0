"""The continuous-batching engine.

A request's way through it: `LLMEngine.generate` (on the caller's event loop) validates and admits a
`Request` (request.py) into an inbox and returns its `RequestStream`. The engine thread's step loop
moves it into the `Scheduler` (scheduler.py), which plans each step as a `BatchPlan`: prefills of new
requests into free slots, grouped by context bucket, then one decode of every running slot. The loop
runs the plan on the backend, hands each request its token and applies token-level stops (stops.py),
then passes the step to the output thread (output.py), which detokenizes (detokenizer.py), cuts stop
strings, records metrics and puts each request's `RequestOutput` delta on its stream.
"""
