"""The continuous-batching engine: requests, scheduler, step loop, stop rules and detokenization."""
