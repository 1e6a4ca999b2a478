"""The engine handles the kv fixtures hand a test, and everything that builds and keeps them.

protocol: what a handle offers a test, the plugin and the assertions (the `Handle` protocol).
factories: engines and prefill/decode pairs built by name through the engine-building hooks (a
conftest's, a plugin's, the built-in engines' plugins');
checkpoints: whether a --kv-canary-model directory can serve a built-in engine.
sided: what every handle is built from (the `RequestSender`, a `Side` per engine, `SidedHandle`);
single: one engine (kv_engine); pd: a prefill/decode pair (kv_pd); parallel: a tensor/pipeline
parallel reference engine, one process per rank (rank: what runs in each of them); start:
`start_engine`, the kv_start_engine function. pool: this process's handles, reused across tests
and replaced when broken.

protocol, factories, checkpoints and pool import no torch: the plugin loads them in every run;
torch loads with sided, single, pd, parallel, rank and start, inside the fixture that starts an
engine.
"""
