"""The differential workload soak: seeded traffic-like workloads driven through an engine handle,
every output checked against an oracle, one verdict per round (docs/soak.md).

    seam_types.py  the types of the seam's soak members (Arrival, TokenScores, EngineDefect),
                   re-exported by canary/seam.py; the one module here beneath the seam
    workload.py  the seeded workloads and their one-line text form (a failure's replay)
    verdicts.py  the verdicts, the oracle checks and the results (no torch)
    runner.py    the soak itself: rounds, judging, shrinking a failure to a replay
    suite.py     the stock soak suite: pytest --kv-canary --pyargs pytest_kvcanary.soak.suite
"""
