"""The example suite, installed as `kvcanary_examples`: `pytest --kv-canary --kv-canary-engine=NAME
--pyargs kvcanary_examples` runs it against any engine, the conformance suite of docs/adapters.md
(every test passes, or skips naming what the engine lacks)."""
