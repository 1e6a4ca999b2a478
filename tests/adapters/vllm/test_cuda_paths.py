"""The adapter's CUDA-build paths, run on a CPU: FlashAttention / FlashInfer caches found through
a cache write that stores as vLLM's does (layout.probe_paged), write-through reporting exactly
what each view's slots then hold, the view built from FlashAttention-shaped metadata padded as
under CUDA graphs, and the platform rules (platform.py). The last test needs a GPU and vLLM's
CUDA build, and skips without them."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvcanary_kernels.records import GroupKind, Half
from pytest_kvcanary.adapters.vllm import platform
from pytest_kvcanary.adapters.vllm.layout import PagedLayout, probe_paged
from pytest_kvcanary.adapters.vllm.write_through import WriteThrough

BLOCKS, BS, HEADS, D = 5, 32, 2, 32
NEW = "blocks, heads, block_size, 2 * head_size"


def _cache(logical: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A zeroed cache of this logical shape whose axes lie in memory in `order` (vLLM's stride order)."""
    physical = torch.zeros([logical[i] for i in order], dtype=dtype)
    return physical.permute([order.index(i) for i in range(len(order))])


def _store(kind: str, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store token i's K / V at slot slots[i] (skipping -1) as the backend's cache write does."""
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, t = divmod(s, BS)
        if kind == "new":  # vLLM 0.26 FlashAttention / FlashInfer: (B, H, N, 2D) -> (B, N, H, D) twice
            k_cache, v_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
            k_cache[b, t], v_cache[b, t] = key[i], value[i]
        elif kind == "swapped":  # a cache write that puts V where K belongs
            k_cache, v_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
            k_cache[b, t], v_cache[b, t] = value[i], key[i]
        elif kind == "flash_attn_old":  # [2, B, N, H, D]
            kv_cache[0, b, t], kv_cache[1, b, t] = key[i], value[i]
        elif kind == "flashinfer_nhd_old":  # [B, 2, N, H, D]
            kv_cache[b, 0, t], kv_cache[b, 1, t] = key[i], value[i]
        else:  # flashinfer_hnd_old: [B, 2, H, N, D]
            kv_cache[b, 0, :, t], kv_cache[b, 1, :, t] = key[i], value[i]


def _layer(kind: str) -> Any:
    impl = SimpleNamespace()
    impl.do_kv_cache_update = lambda layer, key, value, kv_cache, slots: _store(kind, kv_cache, key, value, slots)
    return SimpleNamespace(impl=impl)


# name -> (writer, logical shape, stride order, layout found, pair, views per half of a layer)
CASES = {
    "flash_attn_nhd": ("new", (BLOCKS, HEADS, BS, 2 * D), (0, 2, 1, 3), NEW, True, 1),
    "flash_attn_hnd": ("new", (BLOCKS, HEADS, BS, 2 * D), (0, 1, 2, 3), NEW, True, HEADS),
    "flash_attn_old": ("flash_attn_old", (2, BLOCKS, BS, HEADS, D), (0, 1, 2, 3, 4),
                       "2, blocks, block_size, heads, head_size", False, 1),
    "flashinfer_nhd_old": ("flashinfer_nhd_old", (BLOCKS, 2, BS, HEADS, D), (0, 1, 2, 3, 4),
                           "blocks, 2, block_size, heads, head_size", False, 1),
    "flashinfer_hnd_old": ("flashinfer_hnd_old", (BLOCKS, 2, HEADS, BS, D), (0, 1, 2, 3, 4),
                           "blocks, 2, heads, block_size, head_size", False, HEADS),
}


@pytest.mark.parametrize("name", CASES)
def test_probe_finds_the_layout_the_cache_write_keeps(name):
    writer, logical, order, shape, pair, per_half = CASES[name]
    cache = _cache(logical, order)
    layout = probe_paged(_layer(writer), cache, HEADS, D)
    assert layout == PagedLayout(shape, pair)
    views = layout.views(cache, HEADS, D)
    assert set(views) == ({Half.K} if pair else {Half.K, Half.V})
    for split in views.values():
        assert len(split) == per_half and all(readable for _, _, readable in split)
        assert all(view.shape[:2] == (BLOCKS, BS) for _, view, _ in split)


def test_a_write_the_adapter_does_not_know_is_refused_naming_the_cache():
    cache = _cache((BLOCKS, HEADS, BS, 2 * D), (0, 2, 1, 3))
    with pytest.raises(NotImplementedError, match=r"cache shape \(5, 2, 32, 64\), strides"):
        probe_paged(_layer("swapped"), cache, HEADS, D)


@pytest.mark.parametrize("name", CASES)
def test_write_through_reports_what_each_view_then_holds(name):
    """Padded K / V (CUDA graphs) and a padded slot mapping: per view token, the rows reported for
    each view are that view's bytes at the token's slot after the write."""
    writer, logical, order, _, _, _ = CASES[name]
    cache = _cache(logical, order)
    layer = _layer(writer)
    layout = probe_paged(layer, cache, HEADS, D)
    views = layout.views(cache, HEADS, D)
    reported: dict[tuple[Half, int], torch.Tensor] = {}

    def report(kind: GroupKind, index: int, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        assert kind is GroupKind.FULL
        reported[(Half.K, index) if k is not None else (Half.V, index)] = k if k is not None else v

    through = WriteThrough(report)
    through.wrap_paged(layer, GroupKind.FULL, layout, {h: [p for p, _, _ in v] for h, v in views.items()},
                       {h: 0 for h in views})
    tokens, padding = 7, 9
    slots = torch.tensor(random.Random(name).sample(range(BS, BLOCKS * BS), tokens) + [-1] * padding)
    key = torch.randn(tokens + padding, HEADS, D).to(torch.bfloat16)
    value = torch.randn(tokens + padding, HEADS, D).to(torch.bfloat16)
    through.start_forward(torch.arange(tokens))
    layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
    assert set(reported) == {(h, j) for h, split in views.items() for j in range(len(split))}
    for (half, j), rows in reported.items():
        view = views[half][j][1]
        held = torch.stack([view[s // BS, s % BS].flatten() for s in slots[:tokens].tolist()])
        assert torch.equal(rows, held), (half, j)
    through.end_forward()
    reported.clear()
    layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
    assert not reported


class _Table:
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def get_device_tensor(self, rows: int) -> torch.Tensor:
        return self.table[:rows]


def test_the_view_from_flash_attention_metadata_padded_for_cuda_graphs(monkeypatch):
    """Two requests (a 3-token extend over 40 cached positions, a decode at position 9) padded to
    16 tokens and 3 requests as under CUDA graphs: the inputs keep the two rows, the view has
    their prefix and extend lengths, and write-through's index is the unpadded tokens."""
    vllm_context = pytest.importorskip("vllm.forward_context", reason="vLLM is not installed")
    from pytest_kvcanary.adapters.vllm import forward_inputs
    from pytest_kvcanary.adapters.vllm.blocks import RowPlan
    from pytest_kvcanary.adapters.vllm.engine import VllmEngine

    qsl = torch.tensor([0, 3, 4, 4], dtype=torch.int32)  # a padding request past the two
    metadata = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor([43, 10, 0], dtype=torch.int32),
                               block_table=None, slot_mapping=None, num_actual_tokens=16)
    slots = torch.tensor([3 * BS + 8, 3 * BS + 9, 3 * BS + 10, 4 * BS + 9] + [-1] * 12)
    context = SimpleNamespace(attn_metadata={"layer.0": metadata}, slot_mapping={"layer.0": slots})
    monkeypatch.setattr(vllm_context, "get_forward_context", lambda: context)
    table = torch.zeros(8, 16, dtype=torch.int32)
    table[0, :2], table[1, 0] = torch.tensor([2, 3]), 4
    runner = SimpleNamespace(input_batch=SimpleNamespace(num_reqs=2, req_ids=["a", "b"], block_table=[_Table(table)]),
                             seq_lens=torch.tensor([43, 10, 0, 0, 0, 0, 0, 0], dtype=torch.int32))
    input_ids = torch.arange(16, dtype=torch.int32) + 100
    positions = torch.tensor([40, 41, 42, 9] + [0] * 12)
    inputs = forward_inputs.read(runner, {"input_ids": input_ids, "positions": positions}, ["layer.0"])
    assert inputs.request_ids == ["a", "b"] and inputs.query_start_loc.tolist() == [0, 3, 4]
    assert inputs.seq_lens.tolist() == [43, 10] and inputs.block_tables[0].shape == (2, 16)

    engine = VllmEngine.__new__(VllmEngine)
    engine.device, engine.block_size, engine._full_group = torch.device("cpu"), BS, 0
    engine._table = torch.zeros(8, 16, dtype=torch.int64)
    engine._token_table = torch.full((8, 512), -1, dtype=torch.int64)
    rows = [RowPlan("a", 0, 40, list(range(43))), RowPlan("b", 1, 9, list(range(10)))]
    view, index = engine._map(inputs, rows)
    assert view.rows.tolist() == [0, 1] and view.prefix_lens.tolist() == [40, 9]
    assert view.extend_lens.tolist() == [3, 1] and index.tolist() == [0, 1, 2, 3]
    assert view.input_ids.numel() == 16  # padding past the extend lengths, which the view allows
    assert engine._table[0, :2].tolist() == [2, 3] and engine._token_table[1, :11].tolist() == [*range(10), -1]


def test_platform_arguments():
    assert platform.engine_arguments("cpu", False, None) == dict(enforce_eager=True,
                                                                  kv_cache_memory_bytes=platform.KV_CACHE_BYTES)
    with pytest.raises(ValueError, match="CUDA graphs"):
        platform.engine_arguments("cpu", True, None)
    eager = platform.engine_arguments("cuda", False, "FLASHINFER")
    assert eager["enforce_eager"] is True and eager["attention_backend"] == "FLASHINFER"
    graphs = platform.engine_arguments("cuda", True, None)
    assert graphs["enforce_eager"] is False and graphs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert platform.check_device("cuda:0") == "cuda" and platform.check_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        platform.check_device("cuda:1")


def test_on_cuda_the_adapter_asks_for_the_model_runner_it_reads():
    """vLLM 0.26's CUDA build runs a dense model on its V2 model runner by default, which keeps no
    persistent batch: the adapter asks for V1 there, and refuses a runner without one, naming it."""
    assert platform.engine_environment("cuda") == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert platform.engine_environment("cpu") == {}
    platform.check_model_runner(SimpleNamespace(input_batch=object()))
    with pytest.raises(RuntimeError, match="SimpleNamespace, which keeps no persistent batch"):
        platform.check_model_runner(SimpleNamespace())


def test_cuda_graphs_setting(monkeypatch):
    monkeypatch.setenv(platform.CUDA_GRAPHS_ENV, "1")
    assert platform.default_cuda_graphs() is True
    monkeypatch.setenv(platform.CUDA_GRAPHS_ENV, "yes")
    with pytest.raises(ValueError, match="KVCANARY_VLLM_CUDA_GRAPHS must be one of 0, 1; got 'yes'"):
        platform.default_cuda_graphs()
    monkeypatch.setenv(platform.ATTENTION_BACKEND_ENV, "TRITON_ATTN")
    with pytest.raises(ValueError, match="FLASH_ATTN, FLASHINFER"):
        platform.default_attention_backend()


class _Mode:
    def __init__(self, name: str, full: bool, piecewise: bool) -> None:
        self.name, self._full, self._piecewise = name, full, piecewise

    def has_full_cudagraphs(self) -> bool:
        return self._full

    def has_piecewise_cudagraphs(self) -> bool:
        return self._piecewise


def _config(mode: _Mode, splits: list[str] | None = None) -> Any:
    return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode, splitting_ops=splits))


def test_graph_modes_the_canary_cannot_follow_are_refused():
    model = torch.nn.Linear(1, 1)
    piecewise = _Mode("PIECEWISE", False, True)
    assert platform.check_graph_mode(_config(piecewise, list(platform.EAGER_OPS)), model) == "PIECEWISE"
    assert platform.check_graph_mode(_config(_Mode("NONE", False, False)), model) == "NONE"
    with pytest.raises(RuntimeError, match="FULL CUDA graphs here \\(cudagraph_mode FULL_AND_PIECEWISE\\)"):
        platform.check_graph_mode(_config(_Mode("FULL_AND_PIECEWISE", True, True)), model)
    with pytest.raises(RuntimeError, match="do not split at vllm::unified_kv_cache_update"):
        platform.check_graph_mode(_config(piecewise, ["vllm::unified_attention_with_output"]), model)

    class CUDAGraphWrapper:
        pass

    with pytest.raises(RuntimeError, match="calls a CUDAGraphWrapper"):
        platform.check_graph_mode(_config(piecewise, list(platform.EAGER_OPS)), CUDAGraphWrapper())


def _cuda_build() -> str | None:
    """Why the GPU test cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a GPU (torch sees no CUDA device)"
    try:
        import vllm.platforms

        if not vllm.platforms.current_platform.is_cuda():
            return "needs vLLM's CUDA build (the installed vLLM is not it)"
    except ImportError:
        return "needs vLLM's CUDA build (vLLM is not installed)"
    return None


@pytest.mark.skipif(_cuda_build() is not None, reason=_cuda_build() or "")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "piecewise"])
def test_on_the_gpu_a_clean_run_is_clean_and_a_flipped_byte_is_seen(graphs):
    from pytest_kvcanary.config import PerturbSpec

    from .support import make_engine, make_handle
    from .test_canary import clean_workload, fault_workload

    engine = make_engine("mha", device="cuda", cuda_graphs=graphs)
    assert engine.layout is not None and engine.graph_mode == ("PIECEWISE" if graphs else "NONE")
    handle = make_handle(engine)
    clean_workload(handle, 0)
    assert not handle.violations()
    handle = make_handle(engine, (PerturbSpec("real_kv_used", warmup_steps=1),), 1)
    fault_workload(handle, 1)
    assert handle.violations(), "a flipped byte of a slot a request reads went unseen"
