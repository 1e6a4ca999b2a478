"""The differential workload soak: seeded traffic-like workloads driven through an engine handle,
every output checked against an oracle, one verdict per round (docs/soak.md).

    workload.py  the seeded workloads and their one-line text form (a failure's replay)
    verdicts.py  the verdicts, the oracle checks and the results (no torch)
    runner.py    the soak itself: rounds, judging, shrinking a failure to a replay
    suite.py     the stock soak suite: pytest --kv-canary --pyargs pytest_kvcanary.soak.suite
"""
