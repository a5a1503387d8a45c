"""The op's small per-head tables: what they hold, on either path that writes them."""
import pytest
import torch

from minference_fx.kernels import tables


@pytest.mark.parametrize("values", [(), (7,), (3, 3, 3), (0, 1, 2, 5, 9, 13, 13, 4), (4096, 8192, 100, 256, 256)])
def test_runs_written_by_fill_and_arange_hold_the_values(values):
    """The capture-time path (one fill or arange a run of equal steps) writes exactly ``values``."""
    out = tables._write_runs(torch.full((len(values),), -1, dtype=torch.int32), values)
    assert out.tolist() == list(values)


def test_int_table_on_the_cpu_holds_the_values_as_int32():
    got = tables.int_table([5, 1, 1, 9], "cpu")
    assert got.dtype == torch.int32 and got.tolist() == [5, 1, 1, 9]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int_table_on_cuda_copies_a_pinned_table_once_and_replays_in_a_graph():
    values = (4096, 8192, 100, 256, 256, 1000)
    first = tables.int_table(values, "cuda")
    assert first.tolist() == list(values) and tables._PINNED[values].is_pinned()
    graph, static = torch.cuda.CUDAGraph(), {}
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static["out"] = tables.int_table(values, "cuda") + 0
        static["new"] = tables.int_table((11, 2, 3), "cuda")  # first asked for inside the capture: kernels write it
    graph.replay()
    torch.cuda.synchronize()
    assert static["out"].tolist() == list(values) and static["new"].tolist() == [11, 2, 3]
    assert (11, 2, 3) not in tables._PINNED
