"""How a test selects the cross-process pair: the kv_pd marker, --kv-canary-pd-transport and its ini
key (command line > marker > ini), and the errors bad values get. The engine starter is a stand-in
that reports the EngineKey it is asked for and skips, so no engine starts."""

from __future__ import annotations

import pytest

CONFTEST = """
import pytest

@pytest.fixture(scope="session")
def kv_start_engine():
    def start(key):
        print(f"started kind={key.kind} transport={key.transport}")
        pytest.skip("no engine here")
    return start
"""

TESTS = """
import pytest

@pytest.mark.kv_pd(transport="processes")
def test_marked(kv_pd): pass

def test_plain(kv_pd): pass

def test_single(kv_engine): pass
"""


@pytest.fixture
def pdtester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(TESTS)
    return pytester


def started(result: pytest.RunResult) -> list[str]:
    return [line.split("started ", 1)[1] for line in result.outlines if "started " in line]


@pytest.mark.parametrize(("args", "ini", "expected"), [
    ((), None, ["kind=pd transport=processes", "kind=pd transport=local", "kind=single transport=local"]),
    ((), "processes", ["kind=pd transport=processes", "kind=pd transport=processes", "kind=single transport=local"]),
    (("--kv-canary-pd-transport=local",), "processes",
     ["kind=pd transport=local", "kind=pd transport=local", "kind=single transport=local"]),
], ids=["marker", "ini", "command-line-wins"])
def test_the_transport_comes_from_the_command_line_the_marker_or_the_ini(pdtester, args, ini, expected):
    if ini is not None:
        pdtester.makeini(f"[pytest]\nkv_canary_pd_transport = {ini}\n")
    result = pdtester.runpytest_subprocess("--kv-canary", "-s", "-p", "no:cacheprovider", *args)
    result.assert_outcomes(skipped=3)
    assert started(result) == expected


def test_a_bad_marker_errors_its_test_naming_the_allowed_values(pdtester):
    pdtester.makepyfile(test_bad="""
        import pytest

        @pytest.mark.kv_pd(transport="tcp")
        def test_bad(kv_pd): pass

        @pytest.mark.kv_pd("processes")
        def test_positional(kv_pd): pass
    """)
    result = pdtester.runpytest_subprocess("--kv-canary", "-p", "no:cacheprovider", "test_bad.py")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*kv_pd(transport='tcp'): transport must be one of local, processes; got 'tcp'",
                                 "*kv_pd('processes'): takes the keyword transport only; got 'processes'"])


def test_a_bad_option_is_a_usage_error_naming_the_allowed_values(pdtester):
    result = pdtester.runpytest_subprocess("--kv-canary", "--kv-canary-pd-transport=tcp")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-canary-pd-transport must be one of local, processes; got 'tcp'"])


@pytest.mark.parametrize(("changes", "error", "message"), [
    ({"tp": 2}, "NoParallelEngine", r"runs each side in one process; the test asks for tp=2, pp=1"),
    ({"engine": "transformers"}, "NoPrefillDecodePair", r"runs the reference engine's pair; engine 'transformers'"),
    ({"device": "cuda:0"}, "NoParallelEngine", r"on GPUs needs two, one a side"),
    ({"attention": "hybrid"}, "UnsupportedAttention", r"does not run attention 'hybrid'"),
    ({"attention": "sparse"}, "UnsupportedAttention", r"does not run attention 'sparse': its indexer keys"),
], ids=["parallel", "engine", "one-gpu", "hybrid", "sparse"])
def test_what_the_cross_process_pair_does_not_run_skips_saying_why(changes, error, message):
    """Raised before any process starts; the plugin turns each into a skip of the test."""
    import pytest_kvcanary.handles.start as start
    from pytest_kvcanary.canary.seam import UnsupportedAttention
    from pytest_kvcanary.config import CanaryConfig
    from pytest_kvcanary.handles.factories import NoParallelEngine, NoPrefillDecodePair
    from pytest_kvcanary.handles.pool import EngineKey

    errors = {"NoParallelEngine": NoParallelEngine, "NoPrefillDecodePair": NoPrefillDecodePair,
              "UnsupportedAttention": UnsupportedAttention}
    key = EngineKey(**{"kind": "pd", "canary": CanaryConfig(), "engine": "reference", "attention": "mha",
                       "device": "cpu", "seed": 0, "transport": "processes", **changes})
    with pytest.raises(errors[error], match=message):
        start.start_engine(key)
