"""The harness that the benchmarks and the tests share: a real server process (`server`), a real S3
server and a fault-injecting proxy (`s3`), and small synthetic artifacts (`synthetic`). It ships in the
wheel with the benchmarks, so each of them runs from an installed package; `tests/` imports it too, and
`loadtest/` never imports `tests/`."""
